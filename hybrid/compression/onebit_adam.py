"""1-bit Adam (Tang et al. 2021), the communication side: compress Adam's momentum, not the gradient.

Sign compression with error feedback makes the *sum* of the applied gradients track the true sum, which is
what SGD needs; Adam divides each element by its running RMS and turns the added step-to-step noise into
smaller steps. 1-bit Adam moves the compression past that normaliser:

1. **Warm-up** (`compression.warmup_steps` steps): exact AdamW on the DP mean of the gradients (one fp32
   all-reduce per bucket, in the backward as for `compression=none`). The second moment v settles.
2. **Compression stage**: v is frozen at the warm-up's end (the paper's: `compression.var_refresh_every=0`), or
   refreshed every k-th step (`refresh_every`: by default half the variance's horizon 1/(1 − β₂)) from the exact
   DP mean ḡ of the clipped gradients — one fp32 all-reduce per bucket, counted as DP traffic — as the k steps
   since the last refresh would have moved it: v ← β₂ᵏ·v + (1 − β₂ᵏ)·ḡ², its bias correction at that step. A
   variance frozen for the rest of the run is stale wherever the gradients' scale drifts faster than the run
   ends (β₂ = 0.95 forgets in ~20 steps): on llama-tiny, 200 steps, refreshed every 10 steps, the gap to exact
   AdamW fell from 3.3–4.4 % to 0.6–2.2 % (docs/benchmarks/2026-11-30-onebit-refresh.md). The comm hook
   sends nothing (`local_hook`): each DP rank keeps its own gradient, clips it by its model replica's norm,
   and folds it into the momentum, m ← β₁·m + (1 − β₁)·g. The momentum is then averaged over DP by the
   two-phase sign exchange of `codecs.py` (all-to-all of 1-bit chunks, average, re-encode, all-gather),
   with the worker and server error feedback kept per momentum buffer. Every rank decodes the same bytes,
   so m stays identical across DP; the step is AdamW's with the frozen v, floored at m̂²:
   p ← p·(1 − lr·wd) − lr · m̂ / (√max(v̂, m̂²) + ε),  m̂ = m/(1 − β₁ᵗ),  v̂ = v/(1 − β₂^W).

The optimizer that steps on the exchanged momentum, with the frozen variance, its floor and the flat state
buffers, is `hybrid.optim.onebit_adam.OneBitAdam`; this module holds the hook state, the (empty) gradient
hook of the compression stage and the momentum's exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.compression.codecs import TwoPhaseState, done, exact_mean, two_phase_mean
from hybrid.compression.layout import column_spans, transpose_spans
from hybrid.parallel import collectives as C

if TYPE_CHECKING:
    from hybrid.compression.hooks import Compression


@dataclass
class MomentumExchange(TwoPhaseState):
    """The hook state of `compression=onebit_adam`: the sign codec and its worker/server residuals, kept
    per momentum buffer (one per gradient bucket, by bucket index); `columns`: row-parallel weights' momentum
    laid out column by column for the codec (`compression.block_layout`, `layout.py`)."""

    columns: bool = False
    refresh: Optional[int] = None  # compression.var_refresh_every as configured (null: `refresh_every` sizes it)


def refresh_every(configured: Optional[int], beta2: float) -> int:
    """Steps between the variance's refreshes (0: never): as configured, or half the horizon 1/(1 − β₂) of Adam's
    variance, at least 1 (10 at β₂ = 0.95, 500 at 0.999)."""
    if configured is not None:
        return configured
    return max(1, round(0.5 / (1 - beta2))) if beta2 < 1 else 0


def refresh_phrase(configured: Optional[int], beta2: float) -> str:
    """How the variance of the compression stage is kept, for the start-up line."""
    k = refresh_every(configured, beta2)
    return (f"refreshed from an exact fp32 all-reduce every {k} steps (compression.var_refresh_every=0: frozen)"
            if k else "frozen")


def local_hook(st: MomentumExchange, bucket):  # noqa: ANN001, ANN201  (DDP's hook signature: see hooks.run_hook)
    """The compression stage's gradient hook: no DP communication, each rank keeps its own gradient (the
    optimizer exchanges the momentum instead)."""
    return done(bucket.buffer())


def average_momentum(comp: Compression, buffers: list[tuple[torch.Tensor, Any]]) -> None:
    """Replace each momentum buffer of (buffer, its gradient bucket) by its DP mean through the two-phase sign
    exchange, all buffers in flight together (laid out as `layout.py` says while they are); when `comp.measure`,
    first take each exact mean (one uncounted-as-DP fp32 all-reduce per buffer, counted as `bytes_meter`) and add
    the compression error to `comp`'s meter."""
    st: MomentumExchange = comp.state
    metered = comp.measure and C.size(st.group) > 1
    exact = [exact_mean(m, st.group) for m, _ in buffers] if metered else []
    spans = [column_spans(bucket.parameters()) if st.columns else [] for _, bucket in buffers]
    for (m, _), s in zip(buffers, spans):
        transpose_spans(m, s)
    futures = [two_phase_mean(st, m, bucket.index()) for m, bucket in buffers]
    with C.TIMER.waiting(C.group_name(st.group)):
        for fut in futures:
            fut.wait()  # on CUDA: the optimizer's stream waits for the codec's
    for (m, _), s in zip(buffers, spans):
        transpose_spans(m, s, back=True)
    for (m, bucket), reference in zip(buffers, exact):
        comp.add_error(reference, m, bucket.index())
