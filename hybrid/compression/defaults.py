"""Defaults that keep quality: a lossy method starts exact for a warm-up sized from the run, unless told otherwise.

Early in training the gradients change fast, every rank's gradient is large against the noise a codec adds,
and Adam's second moment is still settling; a method that converges well later can set the run back there
(measured on gpt-tiny: +3 % to +17 % eval loss for methods picked by name and nothing else). PyTorch's own
PowerSGD hook runs exact steps first by default for the same reason (`start_powerSGD_iter`).

`compression.warmup_steps: null` (the default) is ⌈share · train.steps⌉ exact steps (fewer than the run), at
least the method's minimum (where it has one: PyTorch's PowerSGD needs 2), with share =
`compression.warmup_share` or the method's own (`SAFE`); `warmup_steps=0` compresses from the first step (the
behaviour before these defaults) and any other number is taken as is. Under `schedule=auto` a null warm-up is
0: the settling rule decides, `warmup_steps` being each stage's minimum.

Top-k and DGC's density, `compression.fraction: null` (the default), is sized from the run too (`density_of`):
error feedback sends a coordinate about once in 1/density compressed steps, so a short compressed phase needs a
denser selection for every coordinate to be sent a few times.

**The warm-up's exchange**, `compression.warmup_method`: `none` (the default) all-reduces in fp32; `int8` (or
`int4`, `bf16`, `fp16`) runs the warm-up through that codec instead — int8 from a run's first step ended within
−0.8 … +1.5 % of exact on five configurations, at a quarter of the bytes, so a warm-up of the same length costs
a quarter as much over the run (`warmup_cost`); on llama-tiny it cost sign 2.4 points of eval loss on a
three-seed mean and PowerSGD nothing (docs/benchmarks/2026-12-01-warmup-codec.md), so exact stays the default.
The method still starts from the warm-up's last mean (`start.py`), and 1-bit Adam's AdamW steps take the codec's
mean. Not for `zeroone_adam` (its warm-up steps are variance refreshes, exact by design), `hierarchical` or
PyTorch's hooks, nor under `schedule=auto` (`compression.stages` is its ladder).

PowerSGD's byte budget, `compression.min_ratio`, is a ratio over the run, warm-up included: its warm-up steps send
fp32 (or the warm-up codec's bytes), so the compressed steps must do better than the target for the run to reach
it (`bucket_ratio`).

The warm-up decided at a run's start is the run's own state (`Compression.run_state`): a resume keeps it, so
extending a run (`train.steps`, a free change on resume) does not move a warm-up already over.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Optional

from hybrid.compression import CompressionError

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

SAFE: dict[str, tuple[float, int]] = {
    "powersgd": (0.01, 0),  # its rank adapts to its error: a short warm-up (PyTorch's default 10 steps at 1,000)
    "torch_powersgd": (0.01, 2),  # PyTorch's start_powerSGD_iter >= 2 with error feedback
    "sign": (0.25, 0),
    "topk": (0.25, 0),
    "dgc": (0.25, 0),
    "onebit_adam": (0.25, 1),  # the variance it freezes: 1-bit Adam's paper warms up for 15–25 % of the run
}
"""method → (share of `train.steps` run as the warm-up, at least this many steps); methods not named start at once: the
casts, int8 and int4 stayed within 1 % of exact from the first step (docs/benchmarks/2026-11-24-compression-adam.md,
2026-11-28-int4.md)."""
DENSITY_FLOOR, SENDS = 0.01, 10
"""A null `compression.fraction`: max(DENSITY_FLOOR, SENDS / the compressed steps) — each coordinate sent about
SENDS times over the compressed phase; 1 % from 1,000 compressed steps on. On gpt-tiny at 150 compressed steps
top-k at 1 % lost 5.6 % of eval loss, at this rule's 6.7 % 1.4 % (and 0.1–0.6 % on two other configurations:
docs/benchmarks/2026-11-30-compression-defaults.md)."""


def safe_warmup(c: CompressionConfig) -> tuple[float, int]:
    """(share, minimum) of `c`'s method (hierarchical: of its `inner` method); `warmup_share` overrides the share."""
    share, least = SAFE.get(c.inner if c.method == "hierarchical" else c.method, (0.0, 0))
    return (share if c.warmup_share is None else c.warmup_share), least


def sized(c: CompressionConfig, steps: Optional[int]) -> bool:
    """Whether `c`'s warm-up is sized from the run: left null, fixed schedule, a run length known, a method
    that has one."""
    return c.warmup_steps is None and c.schedule == "fixed" and steps is not None and any(safe_warmup(c))


def warmup_of(c: CompressionConfig, steps: Optional[int]) -> int:
    """The exact steps before `c`'s method, for a run of `steps` steps (None: unknown, a null warm-up is the
    method's minimum; under the auto schedule 0)."""
    if c.warmup_steps is not None or c.schedule != "fixed":
        return c.warmup_steps or 0
    share, least = safe_warmup(c)
    if steps is None:
        return least
    return max(least, min(math.ceil(share * steps), steps - 1))


def resolved(c: CompressionConfig, steps: Optional[int]) -> CompressionConfig:
    """A copy of `c` whose `warmup_steps` is the number of steps and whose `min_ratio` is the per-bucket budget
    (`bucket_ratio`): what the methods' factories read."""
    out = copy.copy(c)
    out.warmup_steps = warmup_of(c, steps)
    out.min_ratio = bucket_ratio(c, steps)
    out.fraction = density_of(c, steps)
    return out


def density_of(c: CompressionConfig, steps: Optional[int]) -> float:
    """Top-k's and DGC's share of each chunk sent: `compression.fraction`, or where null, sized from the compressed
    steps (the run less its warm-up; under the auto schedule the whole run): max(DENSITY_FLOOR, SENDS / steps)."""
    if c.fraction is not None:
        return c.fraction
    if not steps:
        return DENSITY_FLOOR
    compressed = steps - (warmup_of(c, steps) if c.schedule == "fixed" else 0)
    return min(1.0, max(DENSITY_FLOOR, SENDS / max(1, compressed)))


def density_phrase(c: CompressionConfig, steps: Optional[int]) -> str:
    """The start-up line's account of top-k's or DGC's density: the share sent and, sized, why."""
    d = density_of(c, steps)
    if c.fraction is not None or not steps:
        return f"; {d:.2%} of each chunk sent"
    return (f"; {d:.2%} of each chunk sent (sized from the run: each coordinate about {SENDS} times over its "
            f"compressed steps, at least {DENSITY_FLOOR:.0%}; compression.fraction=0.01 pins it)")


WARMUP_METHODS = ("none", "bf16", "fp16", "int8", "int4")
"""`compression.warmup_method`: the exchanges a warm-up may run (exact or within rounding of it)."""
NOT_WARMED = ("zeroone_adam", "hierarchical", "torch_fp16", "torch_bf16", "torch_powersgd")
"""Methods whose warm-up is exact whatever `warmup_method` says: refused there (`check_warmup`)."""


def warmup_cost(c: CompressionConfig) -> float:
    """Bytes of one warm-up step against fp32's: 1 exact; the 16-bit casts ½; int8 and int4 one (or half a) byte
    per element plus one fp32 scale per `block_size` elements, ÷ 4 (the codecs' `encoded_bytes`)."""
    per_element = {"none": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}[c.warmup_method]
    scales = 4 / c.block_size if c.warmup_method in ("int8", "int4") else 0.0
    return (per_element + scales) / 4


def exact_share(c: CompressionConfig, steps: Optional[int]) -> float:
    """The share w of a run of `steps` known at its start to run exact: the fixed schedule's warm-up; 0 where
    unknown (no run length, the auto schedule)."""
    return warmup_of(c, steps) / steps if steps and c.schedule == "fixed" else 0.0


def bucket_ratio(c: CompressionConfig, steps: Optional[int]) -> float:
    """The ratio each compressed step must keep for the run, its warm-up share w at cost k (`warmup_cost`: 1 in
    fp32) included, to send `min_ratio` (T) × fewer bytes: 1 / (w·k + (1 − w)/r) ≥ T ⇔ r ≥ (1 − w) / (1/T − w·k).
    T itself where the warm-up is unknown (no run length, the auto schedule) or none, and where w·k ≥ 1/T: the
    warm-up alone keeps the run under T× (`budget_phrase` says so)."""
    w, k = exact_share(c, steps), warmup_cost(c)
    if w == 0 or w * k >= 1 / c.min_ratio:
        return c.min_ratio
    return (1 - w) / (1 / c.min_ratio - w * k)


def budget_phrase(c: CompressionConfig, steps: Optional[int]) -> str:
    """The start-up line's account of PowerSGD's byte budget: per bucket, and what it means over the run."""
    per_bucket, w = bucket_ratio(c, steps), exact_share(c, steps)
    if per_bucket != c.min_ratio:
        return (f"within {per_bucket:.3g}× fewer bytes per bucket, so that the run sends compression.min_ratio="
                f"{c.min_ratio:g}× fewer with its warm-up")
    if w * warmup_cost(c) >= 1 / c.min_ratio:
        return (f"within {c.min_ratio:g}× fewer bytes per bucket; the warm-up alone ({w:.0%} of the run "
                f"{warmup_name(c)}) keeps the run under {c.min_ratio:g}×")
    return f"within {c.min_ratio:g}× fewer bytes per bucket"


def warmup_phrase(c: CompressionConfig, steps: Optional[int]) -> str:
    """The start-up line's account of the warm-up: how long, why, and the setting that changes it."""
    n = warmup_of(c, steps)
    first = "the first step" if n == 1 else f"the first {n} steps"
    how = warmup_name(c) + ("" if c.warmup_method == "none" else " (compression.warmup_method)")
    if not sized(c, steps):
        return f", {how} for {first}" if n else ""
    share = safe_warmup(c)[0]
    return (f", {how} for {first} ({share:.0%} of train.steps={steps}, sized from the run to protect the "
            "loss; compression.warmup_steps=0 compresses from step 1)")


def warmup_name(c: CompressionConfig) -> str:
    """How the warm-up exchanges, in words: exact, or in the warm-up codec."""
    return "exact" if c.warmup_method == "none" else f"in {c.warmup_method}"


def check_warmup(c: CompressionConfig) -> None:
    """The warm-up's knobs (one CompressionError line naming the bad one)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise CompressionError(msg)

    n = c.warmup_steps
    need(n is None or n >= 0, f"compression.warmup_steps must be >= 0 (null: sized from the run), got {n}")
    need(c.warmup_share is None or 0 <= c.warmup_share < 1, f"compression.warmup_share must be in [0, 1), got "
         f"{c.warmup_share}")
    need(c.warmup_method in WARMUP_METHODS, f"compression.warmup_method must be one of {', '.join(WARMUP_METHODS)}, "
         f"got {c.warmup_method!r}")
    need(c.warmup_method == "none" or c.schedule == "fixed", "compression.warmup_method applies to schedule=fixed "
         "(schedule=auto steps through compression.stages)")
    need(c.warmup_method == "none" or c.method not in NOT_WARMED, f"compression.warmup_method={c.warmup_method} does "
         f"not apply to compression={c.method} (its warm-up is exact)")
    fixed = c.schedule == "fixed" and n is not None
    need(not fixed or c.method != "onebit_adam" or n >= 1, f"compression=onebit_adam needs compression.warmup_steps "
         f">= 1 (exact AdamW steps that estimate the variance it then freezes), got {n}")
    need(not fixed or c.method != "torch_powersgd" or not c.error_feedback or n >= 2, "compression=torch_powersgd "
         f"with error feedback needs compression.warmup_steps >= 2 (PyTorch's start_powerSGD_iter), got {n}")
