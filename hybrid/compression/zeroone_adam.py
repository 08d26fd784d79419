"""0/1 Adam (Lu, Li, Zhang, De Sa, He 2022), the communication side: which steps send the exact gradient, which
the momentum as signs, which nothing.

Every step of a run is one of four kinds, decided by `ZeroOneSchedule.kind(t)` from the optimizer's step count t
alone (the same on every rank, and after a resume):

- **refresh** (t ∈ T_v, t ≤ F = `var_freeze_step`): the gradient hook all-reduces the gradient exactly (fp32) and
  the optimizer refreshes Adam's variance from that mean. The paper's rule: the first refresh at step 1, the gap
  after the j-th refresh 2^⌊j/κ⌋ steps (κ = `var_update_scaler`): κ steps in a row, then κ every 2nd step, κ
  every 4th, … — the variance is never more than about t/κ steps old. hybrid caps the gap at G steps
  (`compression.var_refresh_every`; null: half the variance's horizon 1/(1 − β₂), 10 at β₂ = 0.95, 500 at the
  paper's 0.999) and weighs each refresh by the steps it stands for (`gap`, `horizon`): with β₂ = 0.95 Adam's
  variance forgets in ~20 steps, and the paper's uncapped gaps, one β₂ per refresh, left it tens of steps old and
  dominated by the first steps' gradients (llama-tiny: +9.4 % eval loss against exact AdamW;
  docs/benchmarks/2026-12-01-zeroone-variance.md). `var_refresh_every=0` is the paper's rule as written.
  `compression.warmup_steps` makes its first steps refreshes too.
- **onebit** (t ≤ F, not a refresh): the hook sends nothing; the optimizer averages the momentum over DP as signs
  through 1-bit Adam's two-phase exchange (`onebit_adam.average_momentum`, worker and server residuals).
- **local** (t > F): nothing is sent; each replica steps on its own momentum and keeps u, the sum of its steps.
- **sync** (t > F, the end of a sync interval, and the run's last step): after the local step, u goes over DP as
  signs through the same exchange. The interval at the s-th step after F is min(H, 2^⌊(s − 1)/α⌋) (α =
  `local_step_scaler`, H = `local_step_clipper`); step s syncs when the interval divides s.

The knobs set to 0 are sized from the run's length (`ZeroOneSchedule.sized`, given `train.steps` by the DP sync
mode when it builds the optimizer, with `optim.beta2`): F = train.steps // 2; κ the largest ≤ 16 (the paper's)
whose refreshes up to F, gaps capped, stay within 10 % of the steps (1-bit Adam's 10 % warm-up, spread over half
the run); α such that the interval reaches H for the last part of the run. The optimizer is
`hybrid.optim.zeroone_adam.ZeroOneAdam`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from hybrid.compression import CompressionError
from hybrid.compression.codecs import SignCodec
from hybrid.compression.layout import by_columns
from hybrid.compression.onebit_adam import MomentumExchange, local_hook, refresh_every

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

PAPER_SCALER = 16  # the paper's κ (and the largest the auto sizing picks)
REFRESH_SHARE = 0.1  # the auto κ: refreshes up to the freeze within this share of the run
REFRESH, ONEBIT, LOCAL, SYNC = "refresh", "onebit", "local", "sync"
AUTO_KNOBS = ("var_freeze_step", "var_update_scaler", "local_step_scaler")


def refresh_steps(freeze: int, scaler: int, cap: int = 0, warmup: int = 0) -> tuple[int, ...]:
    """The refresh steps up to `freeze`: 1..`warmup`, and the paper's — step 1, then a gap of 2^⌊j/κ⌋ steps after
    the j-th (j from 0; κ = `scaler`) — each gap at most `cap` steps (0: uncapped, the paper's)."""
    out, t, j = set(range(1, min(warmup, freeze) + 1)), 1, 0
    while t <= freeze:
        out.add(t)
        gap = 1 << (j // scaler)
        t, j = t + (min(gap, cap) if cap else gap), j + 1
    return tuple(sorted(out))


@dataclass(frozen=True)
class ZeroOneSchedule:
    """Which kind each step t (counted from 1) is; 0 in a knob: sized from the run (`sized`)."""

    freeze: int  # F, var_freeze_step: the last step that may refresh the variance
    scaler: int  # κ, var_update_scaler
    local_scaler: int  # α, local_step_scaler
    clipper: int  # H, local_step_clipper
    warmup: int = 0  # compression.warmup_steps: refreshes before the rule's
    last: int = 0  # the run's last step (always a sync); 0: not known
    cap: Optional[int] = None  # G, var_refresh_every: the most steps between refreshes (0: the paper's rule)
    at: tuple[int, ...] = ()  # the refresh steps, once sized

    @classmethod
    def of(cls, cfg: CompressionConfig) -> ZeroOneSchedule:
        return cls(cfg.var_freeze_step, cfg.var_update_scaler, cfg.local_step_scaler, cfg.local_step_clipper,
                   cfg.warmup_steps or 0, cap=cfg.var_refresh_every)

    def sized(self, steps: int, beta2: float) -> ZeroOneSchedule:
        """The knobs left at 0 (and a null cap, from Adam's `beta2`) sized from a run of `steps` steps (see the
        module doc)."""
        if steps < 1 and 0 in (self.freeze, self.scaler, self.local_scaler):
            raise ValueError("compression=zeroone_adam sizes its schedule from train.steps: give the run's length")
        freeze, cap = max(self.freeze or max(1, steps // 2), self.warmup), refresh_every(self.cap, beta2)
        budget = max(1, int(REFRESH_SHARE * steps))
        scaler = self.scaler or next((k for k in range(PAPER_SCALER, 0, -1)
                                      if len(refresh_steps(freeze, k, cap)) <= budget), 1)
        local = self.local_scaler or max(1, -(-(steps - freeze) // self.clipper.bit_length()))
        return replace(self, freeze=freeze, scaler=scaler, local_scaler=local, last=steps, cap=cap,
                       at=refresh_steps(freeze, scaler, cap, self.warmup))

    def refreshes(self, t: int) -> int:
        """Refresh steps among 1..t."""
        return bisect.bisect_right(self.at, t)

    def refresh(self, t: int) -> bool:
        return self.refreshes(t) > self.refreshes(t - 1)

    def last_refresh(self, t: int) -> int:
        """The last refresh step at or before t (0: none)."""
        k = self.refreshes(t)
        return self.at[k - 1] if k else 0

    def gap(self, t: int) -> int:
        """The steps the refresh at step t stands for, v ← β₂^gap·v + (1 − β₂^gap)·ḡ²: those since the previous
        refresh; 1 under the paper's rule (one β₂ per refresh)."""
        return t - self.last_refresh(t - 1) if self.cap else 1

    def horizon(self, t: int) -> int:
        """The exponent of v's bias correction 1 − β₂^horizon after step t: the last refresh's step (the refreshes'
        gaps summed); the refreshes so far under the paper's rule."""
        return self.last_refresh(t) if self.cap else self.refreshes(t)

    def signed(self, t: int) -> bool:
        """Whether a step before t sent the momentum as signs: from then on m carries the codec's error, and a
        refresh step's variance is floored at m̂² as the other steps' are."""
        return self.refreshes(t - 1) < t - 1

    def interval(self, t: int) -> int:
        """The sync interval at step t > F: min(H, 2^⌊(s − 1)/α⌋), s = t − F."""
        doublings = (t - self.freeze - 1) // self.local_scaler
        return self.clipper if doublings >= self.clipper.bit_length() else min(self.clipper, 1 << doublings)

    def kind(self, t: int) -> str:
        if t <= self.freeze:
            return REFRESH if self.refresh(t) else ONEBIT
        return SYNC if t == self.last or (t - self.freeze) % self.interval(t) == 0 else LOCAL

    def describe(self) -> str:
        """One line: the refreshes, the freeze, the local steps."""
        local = (f"then local steps, synced every 1, 2, … up to {self.clipper} steps (doubling every "
                 f"{self.local_scaler})") if self.clipper > 1 else "then the momentum's sum synced every step"
        gaps = f"gaps 2^⌊j/κ⌋ up to {self.cap}, each weighted by its steps" if self.cap else "gaps 2^⌊j/κ⌋, the paper's"
        return (f"variance refreshed (exact fp32) at {self.refreshes(self.freeze)} steps up to step {self.freeze} "
                f"(κ={self.scaler}: {gaps}), the momentum sent as signs between; {local}")


@dataclass
class ZeroOneExchange(MomentumExchange):
    """The hook state of `compression=zeroone_adam`: 1-bit Adam's sign codec and residuals (the momentum's up to
    the freeze, then the local steps' sum's), the schedule as configured, the exact mean's hook of the refresh
    steps, and `owner`, the optimizer that drives it: it says whether the step under way refreshes, and holds
    its replica's un-synced state, which the per-rank blob of a checkpoint (`state_dict`) carries."""

    schedule: Optional[ZeroOneSchedule] = None
    exact: Optional[Callable[[Any, Any], Any]] = None
    owner: Any = None

    def refresh_due(self) -> bool:
        if self.owner is None:
            raise CompressionError("compression=zeroone_adam is driven by its optimizer: build it with "
                                   "hybrid.optim.build_optimizer(..., onebit=<this state>)")
        return self.owner.refresh_due()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "local": self.owner.local_state() if self.owner is not None else {}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        if self.owner is not None:
            self.owner.load_local_state(sd.get("local", {}))


def zeroone_hook(st: ZeroOneExchange, bucket):  # noqa: ANN001, ANN201  (DDP's hook signature: see hooks.run_hook)
    """The gradient hook: the exact DP mean on a refresh step, else nothing (the optimizer exchanges)."""
    return st.exact(st.group, bucket) if st.refresh_due() else local_hook(st, bucket)


def make(cfg: CompressionConfig, group: Any, exact: Callable[[Any, Any], Any]) -> tuple[Callable, ZeroOneExchange]:
    """(hook, state) of `compression=zeroone_adam` over `group`; `exact(group, bucket)` is the exact mean's hook."""
    codec = SignCodec(cfg.block_size)
    state = ZeroOneExchange(codec, group, cfg.error_feedback, columns=by_columns(cfg, codec),
                            schedule=ZeroOneSchedule.of(cfg), exact=exact)
    return zeroone_hook, state


def local_steps(cfg: CompressionConfig) -> bool:
    """Whether `cfg` takes 0/1 Adam's local steps: DP replicas then differ between syncs."""
    return cfg.method == "zeroone_adam" and cfg.local_step_clipper > 1


def check_knobs(cfg: CompressionConfig) -> None:
    """The 0/1 Adam knobs (one CompressionError line naming the bad one)."""
    for knob in AUTO_KNOBS:
        if getattr(cfg, knob) < 0:
            raise CompressionError(f"compression.{knob} must be >= 0 (0: sized from train.steps), got "
                                   f"{getattr(cfg, knob)}")
    if cfg.local_step_clipper < 1:
        raise CompressionError(f"compression.local_step_clipper must be >= 1 (1: no local steps), got "
                               f"{cfg.local_step_clipper}")
    if cfg.method == "zeroone_adam" and cfg.schedule != "fixed":
        raise CompressionError("compression=zeroone_adam refreshes Adam's variance on its own schedule "
                               "(compression.var_update_scaler, var_freeze_step): it takes compression.schedule=fixed")
