"""Elastic restarts with the real torchrun: a run restarted on fewer or more ranks carries on.

`parallel=pp2` leaves dp to the world (world / (tp·pp)), so a restart on another number of ranks keeps tp and
pp, recomputes dp, keeps the global batch by changing the microbatches per step (16 samples: 2 microbatches of
4 at dp2, 4 at dp1), and reshards the checkpoint it resumes (`checkpoint.resume=auto`).

- The reference: 4 ranks (pp2 × dp2), 6 steps, a checkpoint every 2, uninterrupted.
- The elastic run: 4 ranks, rank 1 SIGKILLed at the start of step 3 (no restarts: the job ends); the same
  command on 2 ranks (pp2 × dp1) resumes step 2 and is killed at the start of step 5; on 4 ranks again it
  resumes step 4 and finishes. Every step is logged once, and the loss curve equals the reference's to fp32
  tolerance (another dp sums the gradients in another order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_fault_tolerance import dirs, killer_env, run
from test_torchrun import QUICK, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0"]
ELASTIC = [*QUICK, "parallel=pp2", "model.hidden=64", "model.n_layers=2", "model.dropout=0.0", "train.steps=6",
           "checkpoint.every=2", "checkpoint.resume=auto", "train.eval_every=0"]
LOSS_TOL = 2e-5


def launch(nproc: int, tmp: Path, env: dict[str, str], kill: str = "") -> tuple[int, str]:
    module = ["-m", "killer"] if kill else ["-m", "hybrid.train"]
    e = killer_env(env, kill) if kill else env
    r = run([*TORCHRUN, f"--nproc-per-node={nproc}", *module, *ELASTIC, *dirs(tmp)], e)
    return r.returncode, r.stdout + r.stderr


def test_restart_on_fewer_then_more_ranks_keeps_the_loss_curve(tmp_path: Path, env: dict[str, str]) -> None:
    code, out = launch(4, tmp_path / "reference", env)
    assert code == 0, out[-3000:]
    reference = [s["loss"] for s in read_metrics(tmp_path / "reference" / "run")[0]]

    code, out = launch(4, tmp_path / "elastic", env, kill="step:3")
    assert code != 0 and "killer: SIGKILL rank 1 at the start of step 3" in out, out[-3000:]
    code, out = launch(2, tmp_path / "elastic", env, kill="step:5")
    assert code != 0 and "at step 2" in out and "killer: SIGKILL rank 1 at the start of step 5" in out, out[-3000:]
    assert "tp1pp2dp2 → tp1pp2dp1" in out, out[-3000:]  # the resharded resume says what changed
    code, out = launch(4, tmp_path / "elastic", env)
    assert code == 0 and "at step 4" in out and "tp1pp2dp1 → tp1pp2dp2" in out, out[-3000:]

    steps = read_metrics(tmp_path / "elastic" / "run")[0]
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert [s["microbatches"] for s in steps if "microbatches" in s] in ([], [2] * 2 + [4] * 2 + [2] * 2)
    assert [s["loss"] for s in steps] == pytest.approx(reference, rel=LOSS_TOL, abs=LOSS_TOL)
    print(f"\nelastic 4 → 2 → 4 ranks: max |loss − reference| = "
          f"{max(abs(s['loss'] - r) for s, r in zip(steps, reference)):.2e}")
