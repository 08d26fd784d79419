"""Elastic restarts: a run restarted on fewer or more ranks carries on.

`parallel=pp2` leaves dp to the world (world / (tp·pp)), so a restart on another number of ranks keeps tp and
pp, recomputes dp, keeps the global batch by changing the microbatches per step (16 samples: 2 microbatches of
4 at dp2, 4 at dp1), and reshards the checkpoint it resumes (`checkpoint.resume=auto`).

Every run is the real entry point `hybrid.train.main` as the ranks of one run, forked from this process
(hybrid.testing.cli_runs.run_forked_ranks: torchrun's environment for each rank). What changes between the runs
is the world size, as when the same torchrun command (`--max-restarts=0`) is started again with another
`--nproc-per-node`; torchrun's own restarts are tests/e2e/test_fault_tolerance.py's.

- The reference: 2 ranks (pp2 × dp1), 6 steps, a checkpoint every 2, uninterrupted.
- The elastic run: 4 ranks (pp2 × dp2), every rank SIGKILLed at the start of step 3 (killer.py with
  HYBRID_KILL_RANK=all: the job ends where it stands); the same command on 2 ranks (pp2 × dp1) resumes step 2
  and is killed at the start of step 5; on 4 ranks again it resumes step 4 and finishes. Every step is logged
  once, and the loss curve equals the reference's to fp32 tolerance (another dp sums the gradients in another
  order).
"""

from __future__ import annotations

from pathlib import Path

import killer
import pytest
from test_fault_tolerance import dirs
from test_torchrun import QUICK, output, read_metrics

from hybrid.testing.cli_runs import run_forked_ranks

ELASTIC = [*QUICK, "parallel=pp2", "model.hidden=64", "model.n_layers=2", "model.dropout=0.0", "train.steps=6",
           "checkpoint.every=2", "checkpoint.resume=auto", "train.eval_every=0"]
LOSS_TOL = 2e-5
TIMEOUT_S = 240


def launch(world: int, tmp: Path, env: dict[str, str], kill: str = "") -> tuple[list[int], str]:
    """ELASTIC as `world` forked ranks in `tmp`; `kill`: every rank SIGKILLs itself at that point (killer.py)."""
    e = {**env, "HYBRID_KILL": kill, "HYBRID_KILL_RANK": "all"}
    runs = run_forked_ranks(killer.main, [*ELASTIC, *dirs(tmp)], tmp, world, e, timeout_s=TIMEOUT_S)
    return [r.code for r in runs], output(runs)


def test_restart_on_fewer_then_more_ranks_keeps_the_loss_curve(tmp_path: Path, forking: dict[str, str]) -> None:
    for folder in ("reference", "elastic"):
        (tmp_path / folder).mkdir()
    codes, out = launch(2, tmp_path / "reference", forking)
    assert codes == [0, 0], out[-3000:]
    reference = [s["loss"] for s in read_metrics(tmp_path / "reference" / "run")[0]]

    codes, out = launch(4, tmp_path / "elastic", forking, kill="step:3")
    assert codes == [-9] * 4 and out.count("killer: SIGKILL rank") == 4, out[-3000:]
    assert "killer: SIGKILL rank 1 at the start of step 3" in out, out[-3000:]
    codes, out = launch(2, tmp_path / "elastic", forking, kill="step:5")
    assert codes == [-9] * 2 and "at step 2" in out and "SIGKILL rank 1 at the start of step 5" in out, out[-3000:]
    assert "tp1pp2dp2 → tp1pp2dp1" in out, out[-3000:]  # the resharded resume says what changed
    codes, out = launch(4, tmp_path / "elastic", forking)
    assert codes == [0] * 4 and "at step 4" in out and "tp1pp2dp1 → tp1pp2dp2" in out, out[-3000:]

    steps = read_metrics(tmp_path / "elastic" / "run")[0]
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert [s["microbatches"] for s in steps if "microbatches" in s] in ([], [2] * 2 + [4] * 2 + [2] * 2)
    assert [s["loss"] for s in steps] == pytest.approx(reference, rel=LOSS_TOL, abs=LOSS_TOL)
    print(f"\nelastic 4 → 2 → 4 ranks: max |loss − reference| = "
          f"{max(abs(s['loss'] - r) for s, r in zip(steps, reference)):.2e}")
