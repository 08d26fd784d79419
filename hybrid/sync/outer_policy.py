"""DiLoCo's outer step and H chosen from the run (`sync.outer=auto`, `sync.inner_steps=null`), or pinned.

Pinned: `sync.outer=nesterov` (the paper's SGD step, lr 0.7, Nesterov momentum 0.9), `sync.outer=average` (lr 1, no
momentum: the replicas' mean, `sync=local_sgd`), or any of `sync.outer_lr` / `sync.outer_momentum` set (the other
then 0.7 / 0.9, as before the rule existed). Auto: the outer step averages, and becomes the paper's Nesterov step
(one-way) once momentum can help:

- consecutive mean pseudo-gradients agree — cos(Δ̄ₖ, Δ̄ₖ₋₁) > `sync.outer_switch_cos` in each of the last
  `sync.outer_switch_window` outer rounds (momentum accelerates along a direction the outer steps keep taking;
  it overshoots where successive ones turn away), and
- at least `sync.outer_switch_left` outer rounds remain (momentum 0.9 needs about 1/(1 − 0.9) = 10 outer steps to
  build up, and as many to pay off).

The defaults (cos > 0.9 in 3 rounds, 20 rounds left) sit above every cosine measured where the momentum hurt
(docs/slow-links.md, docs/benchmarks/2026-11-29-diloco-defaults.md); with the auto H no run under 12,000 steps
switches. Round 1 has no earlier Δ̄ (its cosine is NaN), nor has the first round after a resume under another
layout (the momentum buffer restarts at zero there).

Δ̄ is the same on every rank after the exchange, so the cosine is too: each rank sums Δ̄·Δ̄ₖ₋₁, ‖Δ̄‖², ‖Δ̄ₖ₋₁‖² over
its own parameters (each counted once across TP and PP), and one all-reduce of those 3 numbers over TP, then PP
(24 bytes, only where tp or pp > 1) per outer round makes the round's cosine the whole model's — every rank decides
alike. While averaging, the momentum buffer holds the last Δ̄ (no memory beyond the paper's step).

H: `sync.inner_steps=null` (the file `sync=diloco`) takes `train.steps // ROUNDS` (at most the paper's 500), so a
run keeps ROUNDS outer rounds whatever its length, and fewer only past ROUNDS · 500 steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid.config import SyncConfig
from hybrid.sync.exchange import require

PAPER = (0.7, 0.9)  # DiLoCo's outer lr and Nesterov momentum
AVERAGE = (1.0, 0.0)  # plain averaging: local SGD
OUTER_CHOICES = ("auto", "nesterov", "average")
ROUNDS, MAX_H = 20, 500  # auto H: outer rounds per run; the paper's H, its ceiling
KEPT = 1000  # rounds whose cosines the run state keeps (the rule reads the last `sync.outer_switch_window`)


def pinned(s: SyncConfig) -> Optional[tuple[float, float]]:
    """(lr, momentum) of a pinned outer step; None under the auto rule."""
    if s.outer == "average":
        return AVERAGE
    if s.outer == "auto" and s.outer_lr is None and s.outer_momentum is None:
        return None
    return (PAPER[0] if s.outer_lr is None else s.outer_lr, PAPER[1] if s.outer_momentum is None else s.outer_momentum)


def auto_inner_steps(steps: int) -> int:
    """H for a run of `steps` steps: ROUNDS outer rounds, H at most MAX_H."""
    return max(1, min(MAX_H, steps // ROUNDS))


def inner_steps(s: SyncConfig, steps: int) -> int:
    """H: `sync.inner_steps`, or (null) chosen from the run's `steps`."""
    return auto_inner_steps(steps) if s.inner_steps is None else s.inner_steps


def check(s: SyncConfig) -> None:
    """The outer step's knobs (one-line ConfigErrors)."""
    require(s.outer in OUTER_CHOICES, f"sync.outer={s.outer!r} is not one of {', '.join(OUTER_CHOICES)}")
    require(s.outer != "average" or (s.outer_lr is None and s.outer_momentum is None), "sync.outer=average is lr 1 "
            "with no momentum: drop sync.outer_lr / sync.outer_momentum, or use sync.outer=nesterov to set them")
    lr, momentum = pinned(s) or PAPER
    require(lr > 0, f"sync.outer_lr must be > 0, got {lr}")
    require(0 <= momentum < 1, f"sync.outer_momentum must be in [0, 1), got {momentum}")
    require(-1 <= s.outer_switch_cos <= 1, f"sync.outer_switch_cos must be in [-1, 1] (a cosine; 1: never switch), "
            f"got {s.outer_switch_cos}")
    require(s.outer_switch_window >= 1 and s.outer_switch_left >= 0, f"sync.outer_switch_window must be >= 1 and "
            f"sync.outer_switch_left >= 0 (outer rounds), got {s.outer_switch_window} and {s.outer_switch_left}")


def describe(s: SyncConfig, steps: int) -> str:
    """The start-up line: H (and where it came from) and what the outer step will do."""
    h = inner_steps(s, steps)
    rounds = -(-steps // h)
    where = f" (from {steps} steps: {rounds} outer rounds)" if s.inner_steps is None else f" ({rounds} outer rounds)"
    return f"sync: diloco, H={h}{where}, outer step: {outer_words(s, steps, h)}"


def outer_words(s: SyncConfig, steps: int, h: int) -> str:
    fixed = pinned(s)
    if fixed == AVERAGE:
        return "averaging (lr 1, no momentum)"
    if fixed is not None:
        kind = "Nesterov" if s.nesterov and fixed[1] else "SGD"
        return f"{kind} lr {fixed[0]:g} μ {fixed[1]:g} (pinned)"
    need = 1 + s.outer_switch_window + s.outer_switch_left  # round 1 has no earlier Δ̄: no cosine
    never = f" — never in this run ({steps // h} rounds < 1 + {s.outer_switch_window} + {s.outer_switch_left})" \
        if steps // h < need else ""
    return (f"averaging until consecutive mean pseudo-gradients agree (cos > {s.outer_switch_cos:g} in "
            f"{s.outer_switch_window} rounds in a row) with ≥ {s.outer_switch_left} outer rounds left, then Nesterov "
            f"lr {PAPER[0]:g} μ {PAPER[1]:g}{never}; sync.outer=nesterov pins the paper's step, sync.outer=average "
            "plain averaging")


@dataclass
class OuterPolicy:
    """The outer step of a run: pinned (`fixed`), or the auto rule's state (the module doc). Run-level state, the
    same on every rank (`run_state`: the trainer's layout-independent part of a checkpoint); under the auto rule it
    is the DP plan's watcher, whose `observe` hands the trainer the line announcing the switch."""

    fixed: Optional[tuple[float, float]]
    h: int
    steps: int
    overlap: int = 0
    switch_cos: float = 0.9
    window: int = 3
    min_left: int = 20
    mode: str = "average"
    switch_step: Optional[int] = None
    cosines: list[float] = field(default_factory=list)  # the last KEPT rounds'
    rounds: int = 0
    line: Optional[str] = None
    run_key = "sync_outer"  # its key in the trainer's state

    @classmethod
    def of(cls, s: SyncConfig, steps: int) -> OuterPolicy:
        return cls(pinned(s), inner_steps(s, steps), steps, s.overlap_steps, s.outer_switch_cos,
                   s.outer_switch_window, s.outer_switch_left)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    @property
    def buffers(self) -> bool:
        """Whether a momentum buffer is kept (auto: the last Δ̄ while averaging)."""
        return self.auto or bool(self.fixed and self.fixed[1])

    def step(self) -> tuple[float, float]:
        """(lr, momentum) of the outer step now."""
        if self.fixed is not None:
            return self.fixed
        return PAPER if self.mode == "nesterov" else AVERAGE

    def decides(self, step: int, last: bool) -> bool:
        """Whether a round ends after step `step` (its last fragment's exchange landed): the same steps on every
        rank, whatever each stage's fragments hold."""
        return self.auto and not last and step > self.overlap and (step - self.overlap) % self.h == 0

    def decide(self, step: int, cos: float) -> None:
        """The round ending after step `step` had cosine `cos` (NaN: undefined, the first round): switch to
        Nesterov from the next outer step when the rule says so."""
        self.rounds += 1
        self.cosines = [*self.cosines, cos][-KEPT:]
        recent, left = self.cosines[-self.window:], (self.steps - step) // self.h
        if self.mode == "average" and len(recent) == self.window and all(c > self.switch_cos for c in recent) \
                and left >= self.min_left:
            self.mode, self.switch_step = "nesterov", step
            self.line = (f"sync: outer step → Nesterov lr {PAPER[0]:g} μ {PAPER[1]:g} after step {step}: cos of "
                         f"consecutive mean pseudo-gradients {', '.join(f'{c:.3f}' for c in recent)} "
                         f"(> sync.outer_switch_cos={self.switch_cos:g}) with {left} outer rounds left")

    def observe(self, step: int, loss: Callable[[], float]) -> Optional[str]:
        """The watcher's hook after each step: the switch's line, once (the loss is not read)."""
        line, self.line = self.line, None
        return line

    def record(self, step: int) -> dict[str, Any]:
        """The metrics record's outer-step keys: the mode now and the last round's cosine."""
        out: dict[str, Any] = {"sync_outer": self.mode}
        if self.cosines and math.isfinite(self.cosines[-1]):
            out["sync_outer_cos"] = self.cosines[-1]
        return out

    def run_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "switch_step": self.switch_step, "cosines": list(self.cosines),
                "rounds": self.rounds}

    def load_run_state(self, state: dict[str, Any]) -> None:
        self.mode, self.switch_step = str(state["mode"]), state["switch_step"]
        self.cosines, self.rounds = [float(c) for c in state["cosines"]][-KEPT:], int(state["rounds"])
