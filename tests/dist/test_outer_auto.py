"""DiLoCo's auto outer step (`sync.outer=auto`, `hybrid.sync.outer_policy`) on 4 gloo ranks at tp2dp2: every rank
measures the same cosine of consecutive mean pseudo-gradients (each rank's sums over its TP shard, all-reduced over
TP), so every rank switches to Nesterov after the same step, and the replicas end with one model; a run saved
before the switch and resumed — in the same layout, and at tp1pp2dp2 — carries the decisions on (the run-level
`sync_outer` state of the trainer's checkpoint part), the same-layout one bit for bit.

H=1, 4 steps: rounds end after steps 1–3 (after step 4 the final sync); with `outer_switch_cos=-1`,
`outer_switch_window=2` and no rounds required left, the rule switches after the first two defined cosines: round
1's is undefined (no earlier Δ̄), so after step 3 — one step after the save at step 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pp_helpers import Case, layout_context
from test_checkpoint import SAVE_AT, _resume, _trainer, _weights, resume_cfgs
from tp_helpers import run_frozen

from hybrid.checkpoint import step_path
from hybrid.trainer import Trainer

TIMEOUT = 300
AUTO = ("sync=diloco", "sync.inner_steps=1", "sync.outer_switch_cos=-1", "sync.outer_switch_window=2",
        "sync.outer_switch_left=0", "model.n_layers=2", "train.global_batch_size=8")
BASE, OTHER = Case(tp=2, pp=1), Case(tp=1, pp=2)


def _train(trainer: Trainer) -> dict[str, Any]:
    """Train to the end, saving as configured; the losses, the switch lines, the records' outer keys."""
    losses, lines, records = [], [], []
    while trainer.step < trainer.cfg.train.steps:
        losses.append(trainer.train_step().loss)
        if line := trainer.dp.observe(trainer.step, lambda: 0.0):
            lines.append(line)
        records.append(trainer.dp.stage_record(trainer.step + 1))
        trainer.checkpointer.after_step(trainer.step)
    trainer.checkpointer.wait()
    return {"losses": losses, "lines": lines, "records": records, "state": trainer.dp.state_dict()["sync_outer"],
            "final": _weights(trainer)}


def runs(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Rank function: the uninterrupted run (saving at step 2), its resume in the same layout, and at tp1pp2."""
    cfgs = resume_cfgs(world, root, BASE, [OTHER], AUTO)
    ctx = layout_context(world, BASE)
    out = {"base": _train(_trainer(cfgs["base"], ctx))}
    out["same"] = _train(_resume(cfgs["same"], ctx, step_path(root / "base", SAVE_AT)))
    other = _resume(cfgs[str(OTHER)], layout_context(world, OTHER), step_path(root / "base", SAVE_AT))
    out["other_loaded"] = dict(other.dp.state_dict()["sync_outer"])
    out["other"] = _train(other)
    return out


@pytest.mark.timeout(2 * TIMEOUT)
def test_every_rank_switches_alike_and_the_decisions_survive_a_resume(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    resume_cfgs(4, tmp_path, BASE, [OTHER], AUTO)
    results = run_frozen(runs, 4, tmp_path, timeout=TIMEOUT)
    base = results[0]["base"]
    assert base["state"]["switch_step"] == 3 and base["state"]["rounds"] == 3
    assert base["lines"][0].startswith("sync: outer step → Nesterov lr 0.7 μ 0.9 after step 3")
    assert [r["sync_outer"] for r in base["records"]] == ["average"] * 2 + ["nesterov"] * 2  # from now on
    for r in results:
        assert repr(r["base"]["state"]) == repr(base["state"]) and r["base"]["lines"] == base["lines"]  # alike
        for name, w in base["final"].items():
            assert torch.equal(r["base"]["final"][name], w), name  # both replicas: one model after the final sync
            assert torch.equal(r["same"]["final"][name], w), name  # bit for bit after the resume
        assert repr(r["same"]["state"]) == repr(base["state"]) and r["same"]["losses"] == base["losses"][SAVE_AT:]
        loaded = r["other_loaded"]  # the decisions up to the save, under another layout
        assert (loaded["rounds"], loaded["mode"], loaded["cosines"][1]) == (2, "average", base["state"]["cosines"][1])
        other = r["other"]["state"]  # carried on; the momentum (the last Δ̄) restarts at zero there: round 3 NaN
        assert other["rounds"] == 3 and other["cosines"][1] == loaded["cosines"][1] and math.isnan(other["cosines"][2])
