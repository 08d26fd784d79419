"""`hybrid.nonfinite.Guard`'s bookkeeping in one process (no process group: the world is this process):
how many non-finite steps in a row `skip` takes before it stops, that a finite step resets that count, where
the LR schedule stands (Megatron: a skipped step does not advance it), the count through a checkpoint's run
state (and its absence in an older one), rewinding with no checkpoint, and which entries of a DP hook's
state a skip drops. The reference for each is the documented rule, replayed step by step in the test; the
multi-rank behaviour is tests/e2e/test_nonfinite.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hybrid.nonfinite import Guard, NonFiniteStop, without_nonfinite


class Hook:
    """A DP hook state with the protocol checkpoints use: per-bucket residuals and PowerSGD-like Q lists."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {"method": "sign", "residual": {0: torch.ones(3), 1: torch.tensor([1.0, math.nan])},
                                   "q": {0: [torch.ones(2), torch.full((2,), math.inf)], 1: [torch.ones(2)]}}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def guard(tmp: Path, mode: str, limit: int, deferred: bool = False) -> tuple[Guard, SimpleNamespace, nn.ModuleList]:
    cfg = SimpleNamespace(on_nonfinite=mode, max_skipped_steps=limit)
    checkpointer = SimpleNamespace(root=tmp, wait=lambda: None)
    hook = Hook()
    g = Guard(cfg, SimpleNamespace(rank=0), checkpointer, lambda line: None,  # type: ignore[arg-type]
              hook_state=lambda: hook, deferred=deferred)
    trainer = SimpleNamespace(step=0, hook=hook)
    return g, trainer, nn.ModuleList([nn.Linear(2, 2)])


def step(g: Guard, trainer: SimpleNamespace, model: nn.ModuleList, bad: bool, due: bool = True) -> bool:
    """One step as the trainer runs it: gradients, the optimizer's norm, `inspect`, the count, `settle`."""
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan if bad else 1.0)
    norm = torch.tensor(math.nan if bad else 1.0)
    g.inspect(norm, model, trainer.step + 1, torch.tensor(2.5), due)
    trainer.step += 1
    return g.settle(trainer, SimpleNamespace(loss=2.5))


def test_skip_counts_in_a_row_and_holds_the_schedule_back(tmp_path: Path) -> None:
    g, trainer, model = guard(tmp_path, "skip", 2)
    pattern = [False, True, True, False, True, True]  # at most 2 bad steps in a row: all skipped
    skipped, in_a_row, lr_steps = 0, 0, []
    for bad in pattern:
        lr_steps.append(g.lr_step(trainer.step))
        assert step(g, trainer, model, bad) is False
        in_a_row = in_a_row + 1 if bad else 0
        skipped += bad
        assert (g.skipped, g.in_a_row) == (skipped, in_a_row)
    expected = [s - sum(pattern[:s]) for s in range(len(pattern))]  # step s runs at s − skipped before it
    assert lr_steps == expected
    with pytest.raises(NonFiniteStop, match=r"step 7: .* 3 such steps in a row \(train.max_skipped_steps=2\)"):
        step(g, trainer, model, True)


def test_the_skipped_count_travels_in_the_run_state(tmp_path: Path) -> None:
    g, trainer, model = guard(tmp_path, "skip", 5)
    step(g, trainer, model, True)
    other, _, _ = guard(tmp_path, "skip", 5)
    other.load_state_dict({"step": 1, **g.state_dict()})
    assert (other.skipped, other.lr_step(7)) == (g.skipped, g.lr_step(7)) and g.record() == g.state_dict()
    other.load_state_dict({"step": 1})  # a checkpoint from before the key: nothing was skipped
    assert other.skipped == 0


def test_stop_names_the_parameter_and_rewind_needs_a_checkpoint(tmp_path: Path) -> None:
    g, trainer, model = guard(tmp_path, "stop", 5)
    first = next(name for name, _ in model[0].named_parameters())  # a chunk's names are the global ones
    with pytest.raises(NonFiniteStop, match=rf"step 1: .*loss 2.5.*first non-finite gradient: {first} \(rank 0\)"):
        step(g, trainer, model, True)
    g, trainer, model = guard(tmp_path, "rewind", 5)
    with pytest.raises(NonFiniteStop, match="has no checkpoint of this run to rewind to"):
        step(g, trainer, model, True)


def test_a_skip_drops_the_hook_entries_the_bad_gradient_spoilt(tmp_path: Path) -> None:
    g, trainer, model = guard(tmp_path, "skip", 5)
    before = trainer.hook.sd
    step(g, trainer, model, True)
    after = trainer.hook.sd
    kept = {k: [i for i, v in before[k].items() if bool(torch.isfinite(torch.stack(list(v) if isinstance(v, list)
                                                                                   else [v])).all())]
            for k in ("residual", "q")}
    assert {k: list(after[k]) for k in kept} == kept and after["method"] == "sign"
    assert without_nonfinite(after) == after  # nothing non-finite is left


def test_a_deferred_stop_reads_at_the_due_step_and_names_the_bad_one(tmp_path: Path) -> None:
    """Deferred (the optimizer refused the step on the device): steps 1-2 keep their norms unread, step 3 (due)
    reads them and stops on step 2; a save (`verify`) reads what is kept too. Skip and rewind never defer."""
    g, trainer, model = guard(tmp_path, "stop", 5, deferred=True)
    assert step(g, trainer, model, False, due=False) is False and step(g, trainer, model, True, due=False) is False
    assert len(g.pending) == 2 and g.found is None
    with pytest.raises(NonFiniteStop, match=r"step 2: .*loss 2.5, grad norm nan.*read at step 3.*stopped"):
        step(g, trainer, model, False, due=True)
    g, trainer, model = guard(tmp_path, "stop", 5, deferred=True)
    step(g, trainer, model, True, due=False)
    with pytest.raises(NonFiniteStop, match=r"step 1: .*read at step 1"):
        g.verify()
    assert not guard(tmp_path, "skip", 5, deferred=True)[0].deferred
    assert not guard(tmp_path, "rewind", 5, deferred=True)[0].deferred
