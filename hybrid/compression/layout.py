"""Block codecs' layout of a bucket: row-parallel weights compressed column by column.

A block codec (int8, int4, sign; 1-bit and 0/1 Adam's momentum exchange) gives each run of
`compression.block_size` consecutive elements of the flat bucket one scale. A weight's gradient is laid out row
by row, so a block is a piece of one row: one output unit over a run of input channels. dW[i, j] = Σₜ δᵢ(t)·xⱼ(t)
follows the input channel's activation xⱼ; the input of a row-parallel weight (an MLP's down projection,
attention's output projection) is an activation whose channels differ in scale by orders of magnitude (SwiGLU's
gated product above all), so a block's one scale, set by its few large channels, fits the rest badly: the sign
codec's relative error on llama-tiny's down projections is 0.88–0.95 along the run, against ~0.6 for every other
matrix. Laid out column by column a block is one input channel over a run of output units, one scale per channel:
0.54–0.60 (`python -m hybrid.bench.gradient_fit`).

`compression.block_layout=auto` (the default) transposes those weights' gradients — the parameters flagged
`column_blocks` (`hybrid.parallel.params`), set by `RowParallelLinear` — inside the bucket before the codec, in
place, and back once the mean is decoded. It is a fixed permutation of the bucket, the same at every step, so the
residuals of error feedback stay in it from step to step (and in checkpoints); no byte changes (the same elements
in the same blocks). `rows` keeps every gradient as laid out. The exact stages, the buckets kept exact, top-k, DGC,
PowerSGD, ZeRO's encoded reduce-scatter (which hands each rank its shard of the flat bucket) and hierarchical's
inner method (which sees a range of rows of the bucket) are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hybrid.compression.codecs import Codec, TwoPhaseState, two_phase_hook, two_phase_mean

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

LAYOUTS = ("auto", "rows")
Span = tuple[int, int, int]  # (offset in the flat bucket, rows, cols) of a weight laid out column by column


def column_spans(params: Sequence[torch.Tensor]) -> list[Span]:
    """Where the flagged 2-D weights among `params` (a bucket's, in order, packed from offset 0) lie: those whose
    `hybrid.parallel.params.ParamInfo` record (`p.hybrid`, read here without importing it) has `column_blocks`."""
    spans, at = [], 0
    for p in params:
        if p.ndim == 2 and getattr(getattr(p, "hybrid", None), "column_blocks", False):
            spans.append((at, p.shape[0], p.shape[1]))
        at += p.numel()
    return spans


def transpose_spans(flat: torch.Tensor, spans: Sequence[Span], back: bool = False) -> None:
    """Lay each span of `flat` out column by column (its transpose, row-major), in place; `back` undoes it."""
    for at, rows, cols in spans:
        part = flat[at: at + rows * cols]
        shape = (cols, rows) if back else (rows, cols)
        part.copy_(part.view(shape).t().reshape(-1))


def bucket_spans(bucket: Any) -> list[Span]:
    """`column_spans` of a bucket's parameters; none for a bucket whose gradients are not its parameters'
    (hierarchical's row range of one)."""
    params = bucket.parameters()
    whole = [tuple(p.shape) for p in params] == [tuple(g.shape) for g in bucket.gradients()]
    return column_spans(params) if whole else []


def column_hook(st: TwoPhaseState, bucket: Any) -> torch.futures.Future:
    """The two-phase exchange (`codecs.two_phase_hook`) with the bucket's row-parallel weights laid out column
    by column while it runs (`bucket_spans`): transposed in place, exchanged, and transposed back in the future's
    callback."""
    buf, spans = bucket.buffer(), bucket_spans(bucket)
    if not spans:
        return two_phase_mean(st, buf, bucket.index())
    transpose_spans(buf, spans)

    def restore(fut: torch.futures.Future) -> torch.Tensor:
        transpose_spans(fut.value(), spans, back=True)
        return fut.value()

    return two_phase_mean(st, buf, bucket.index()).then(restore)


def by_columns(cfg: CompressionConfig, codec: Codec) -> bool:
    """Whether `codec` runs with row-parallel weights laid out column by column: a block codec under
    `compression.block_layout=auto` (top-k selects by magnitude alone: its layout does not matter)."""
    return cfg.block_layout == "auto" and hasattr(codec, "block")


def two_phase_for(cfg: CompressionConfig, codec: Codec) -> Callable[[TwoPhaseState, Any], torch.futures.Future]:
    """The gradient hook of a two-phase method: `column_hook` where `by_columns`, else `two_phase_hook`."""
    return column_hook if by_columns(cfg, codec) else two_phase_hook
