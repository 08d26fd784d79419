"""Context parallelism end to end: a run of the real entry point resumed cp2 → cp4 → cp1 keeps the loss curve.

Every run is `hybrid.train.main` as ranks forked from this process. The reference: dp2, 6 steps. The CP run:
`parallel.cp=2` on 2 ranks (the two split every sequence), a checkpoint every 2 steps, every rank SIGKILLed at the
start of step 3 (killer.py); the same command at `parallel.cp=4` on 4 ranks resumes step 2 and is killed at the
start of step 5; at `parallel.cp=1` (dp2) it resumes step 4 and trains to 6. Each resume names the layout change.
Every step's loss equals the reference's to fp32 tolerance (CP sums the attention and the gradients in another
order).
"""

from __future__ import annotations

from pathlib import Path

import killer
from test_fault_tolerance import dirs
from test_torchrun import QUICK, output, read_metrics

from hybrid.testing.cli_runs import run_forked_ranks

CP = [*QUICK, "model.hidden=64", "model.n_layers=2", "model.dropout=0.0", "train.steps=6", "checkpoint.every=2",
      "checkpoint.resume=auto", "train.eval_every=0"]
LOSS_TOL = 2e-5
TIMEOUT_S = 240


def launch(tmp: Path, env: dict[str, str], *extra: str, kill: str = "", world: int = 2) -> str:
    """CP + `extra` as `world` forked ranks in `tmp`; `kill`: all SIGKILL themselves there (killer.py)."""
    e = {**env, "HYBRID_KILL": kill, "HYBRID_KILL_RANK": "all"}
    runs = run_forked_ranks(killer.main, [*CP, *dirs(tmp), *extra], tmp, world, e, timeout_s=TIMEOUT_S)
    assert [r.code for r in runs] == [-9 if kill else 0] * world, output(runs)[-3000:]
    return output(runs)


def test_a_run_resumed_cp2_cp4_cp1_keeps_the_loss_curve(tmp_path: Path, forking: dict[str, str]) -> None:
    for folder in ("reference", "cp"):
        (tmp_path / folder).mkdir()
    launch(tmp_path / "reference", forking)
    reference = [s["loss"] for s in read_metrics(tmp_path / "reference" / "run")[0]]
    out = launch(tmp_path / "cp", forking, "parallel.cp=2", kill="step:3")
    assert "cp2" in out, out[-3000:]  # the layout map names the axis
    out = launch(tmp_path / "cp", forking, "parallel.cp=4", kill="step:5", world=4)
    assert "at step 2" in out and "tp1cp2pp1dp1 → tp1cp4pp1dp1" in out, out[-3000:]
    out = launch(tmp_path / "cp", forking, "parallel.cp=1")
    assert "at step 4" in out and "tp1cp4pp1dp1 → tp1pp1dp2" in out, out[-3000:]
    steps = read_metrics(tmp_path / "cp" / "run")[0]
    assert [s["step"] for s in steps] == list(range(1, 7))
    for s, want in zip(steps, reference):
        assert abs(s["loss"] - want) <= LOSS_TOL * abs(want), (s["step"], s["loss"], want)
