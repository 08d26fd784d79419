"""What is compressed when: `compression.schedule=auto` (start exact, step to compression once the loss
curve has settled) and the parameters kept exact (`compression.exact_params`).

Early in training the gradients change fast and every rank's gradient is large against the noise a
codec adds; a method that converges well later can set the run back there (error feedback and frozen
Adam variances both assume a slowly moving gradient). A fixed `compression.warmup_steps` needs the
user to know when that phase ends; the auto schedule finds out from the run itself.

**Stages.** `["none", *compression.stages, compression.method]`: exact all-reduce, then each of the
intermediate methods (e.g. `[bf16, int8]`), then the method. Stage i+1 begins at step `bounds[i]`
(steps done when it was decided). Under `schedule=fixed` there is one bound, `compression.warmup_steps`.

**The rule (`Plateau`).** After every step, each rank appends the step's training loss (the DP mean,
which every rank already holds, bit for bit, so all ranks decide alike with no collective) to the
current stage's window. Once the stage has run at least `compression.warmup_steps` steps and holds
2·W losses (W = `compression.settle_window`), the loss has *settled* when the mean of the last W
losses is less than `compression.settle_tol` (relative) below the mean of the W before:
(mean(L[−2W:−W]) − mean(L[−W:])) / mean(L[−2W:−W]) < settle_tol. The next stage begins with the next
step and its window starts empty, so each method gets its own W steps to show the loss still falls
before the following one comes. A non-finite loss never settles (the run stays where it is).

The bounds decided so far and the current window are the run's own state (`state_dict`): a
checkpoint keeps them layout-independent, so a resumed run, under any layout, decides as the
uninterrupted one would.

**Kept exact.** `compression.exact_params` names kinds of parameters synced by the exact all-reduce at every
stage, in DP buckets of their own: `vectors` (1-D: norm weights and biases), `embeddings`, or a pattern of
parameter names (`fnmatch`, e.g. `head.*`, `*.mlp.*`). Unset, it is `[vectors]` under `schedule=auto` and
nothing under `schedule=fixed`.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from hybrid.compression import CompressionError

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

SCHEDULES = ("fixed", "auto")


@dataclass
class Plateau:
    """The settling rule: the relative drop of the loss's mean over the last `window` steps against the
    `window` before, below `tol`."""

    window: int
    tol: float

    def drop(self, losses: list[float]) -> Optional[float]:
        """(mean of the previous window − mean of the last) / mean of the previous; None before 2 windows."""
        if len(losses) < 2 * self.window:
            return None
        w = self.window
        before, last = sum(losses[-2 * w:-w]) / w, sum(losses[-w:]) / w
        return (before - last) / abs(before) if before else math.inf

    def settled(self, losses: list[float]) -> bool:
        d = self.drop(losses)
        return d is not None and math.isfinite(d) and d < self.tol


@dataclass
class StageSchedule:
    """Which stage each step runs: 0 is exact, i the i-th of `names`. `rule` None: the bounds are given
    (`schedule=fixed`); else `observe` finds them as training goes, no stage shorter than `min_steps`."""

    names: list[str]
    bounds: list[int] = field(default_factory=list)
    rule: Optional[Plateau] = None
    min_steps: int = 0
    losses: list[float] = field(default_factory=list)  # the current stage's, the last 2·window kept

    def stage(self, step: int) -> int:
        """The stage of the step that follows `step` steps done."""
        return bisect.bisect_right(self.bounds, step)

    def method(self, step: int) -> str:
        return self.names[self.stage(step)]

    def done(self) -> bool:
        return len(self.bounds) == len(self.names) - 1

    def observe(self, step: int, loss: float) -> Optional[str]:
        """After step `step` (counted from 1) with training loss `loss`: begin the next stage with the next
        step when the loss has settled; return the line that says so, else None."""
        if self.rule is None or self.done():
            return None
        self.losses = [*self.losses, loss][-2 * self.rule.window:]
        start = self.bounds[-1] if self.bounds else 0
        if step - start < self.min_steps or not self.rule.settled(self.losses):
            return None
        drop, w = self.rule.drop(self.losses), self.rule.window
        self.bounds.append(step)
        self.losses = []
        old, new = self.names[len(self.bounds) - 1], self.names[len(self.bounds)]
        moved = f"fell {drop:.2%} below" if drop >= 0 else f"rose {-drop:.2%} above"
        return (f"compression: {old} → {new} from step {step + 1}: the loss's mean over steps {step - w + 1}–{step} "
                f"{moved} the {w} before (settled: < compression.settle_tol={self.rule.tol:g})")

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "bounds": list(self.bounds), "losses": list(self.losses)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The decisions of the run resumed; another stage list (a changed config) starts over at its
        current position: the stages already passed keep their bounds when their names agree."""
        same = [b for i, b in enumerate(sd["bounds"]) if sd["names"][: i + 2] == self.names[: i + 2]]
        self.bounds = same
        self.losses = list(sd["losses"]) if len(same) == len(sd["bounds"]) else []


EXACT_KINDS = ("vectors", "embeddings")


def exact_kinds(exact_params: Optional[Sequence[str]], schedule: str) -> list[str]:
    """`compression.exact_params`, its null resolved: `[vectors]` under `schedule=auto`, else none (the
    fixed methods compress every parameter, as their byte formulas count)."""
    if exact_params is not None:
        return list(exact_params)
    return ["vectors"] if schedule == "auto" else []


def is_name_pattern(entry: str) -> bool:
    """Whether an `exact_params` entry is a pattern of parameter names rather than a kind: it holds a glob
    character or a dot (`head.weight`, `*.mlp.*`); a bare word must be one of EXACT_KINDS."""
    return any(c in entry for c in "*?[.")


def exact_param_ids(named: Iterable[tuple[str, nn.Parameter]], kinds: Sequence[str]) -> frozenset[int]:
    """ids of the parameters kept exact: `vectors` the 1-D ones (norm weights, biases: under 1% of the
    bytes, and a norm's scale multiplies everything after it), `embeddings` those named `*embed*` (token and
    position embeddings, and with them a tied output head: rows of rare tokens get rare, sparse gradients),
    and those whose name (the model's, as `named_parameters` gives it) matches a pattern entry."""
    patterns = [k for k in kinds if is_name_pattern(k)]

    def kept(name: str, p: nn.Parameter) -> bool:
        return (("vectors" in kinds and p.ndim < 2) or ("embeddings" in kinds and "embed" in name)
                or any(fnmatch.fnmatchcase(name, pat) for pat in patterns))
    return frozenset(id(p) for name, p in named if kept(name, p))


def check_schedule(cfg: CompressionConfig, flat: Sequence[str], momentum: Sequence[str]) -> None:
    """The schedule's knobs (CompressionError, one line): `flat` are the methods a stage may be, `momentum`
    those that compress the optimizer's momentum (no stages)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise CompressionError(msg)

    need(cfg.schedule in SCHEDULES, f"compression.schedule={cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    kinds = cfg.exact_params or []
    need(all(k in EXACT_KINDS or is_name_pattern(k) for k in kinds), f"compression.exact_params={list(kinds)} "
         f"may hold only {', '.join(EXACT_KINDS)} or patterns of parameter names (with * or ., e.g. head.*)")
    if cfg.schedule != "auto":
        need(not cfg.stages, "compression.stages needs compression.schedule=auto (the stages it steps through)")
        return
    need(cfg.method != "none", "compression.schedule=auto switches from exact to a compressed method: set one "
         "(compression=<method>)")
    need(cfg.method != "torch_powersgd", "compression=torch_powersgd starts at its own step (PyTorch's "
         "start_powerSGD_iter = compression.warmup_steps): it takes compression.schedule=fixed")
    need(all(m in flat for m in cfg.stages), f"compression.stages={list(cfg.stages)} may hold only "
         f"{', '.join(flat)}")
    need(not cfg.stages or cfg.method not in momentum, f"compression={cfg.method} compresses the momentum "
         "after an exact warm-up: it takes no compression.stages")
    need(cfg.settle_window >= 1, f"compression.settle_window must be >= 1, got {cfg.settle_window}")
    need(cfg.settle_tol > 0, f"compression.settle_tol must be > 0, got {cfg.settle_tol}")
