"""Block codecs on scaled values: each element divided by its expected magnitude before the codec, multiplied back
after.

A block codec (int8, int4, sign) gives each block of `compression.block_size` consecutive elements one scale, so
an element far smaller than its block's largest is coded badly: sign sends it at the block's mean magnitude,
int4 rounds it to zero. A weight gradient dW[i, j] = Σₜ δᵢ(t)·xⱼ(t) has both its rows' scales (the output units'
δ: some residual-stream dimensions far larger than others) and its columns' (the input channels' x: SwiGLU's gated
product above all); the column layout (`layout.py`) serves the columns only. Divided by Adafactor's factored
estimate of its magnitude, √(Rᵢ·Cⱼ / mean R) with R and C the DP mean of the matrix's rows' and columns' mean
squares, every element is of order one and a block's one scale fits it.

`compression.scale=factored` (`auto` chooses it for sign) costs one extra fp32 all-reduce per bucket of its
matrices' row and column statistics, rows + cols floats per matrix (`stats_bytes`), so that every rank divides by
the same scale and the decoded mean is multiplied back exactly; vectors are not scaled. The scale is floored at
`FLOOR` × its matrix's mean (a row or column absent from the batch: an embedding's); a matrix whose gradient is
zero everywhere keeps scale 1. 1-bit and 0/1 Adam's momentum exchange is not scaled: divided by Adam's √v, or by
its own factored scale, it lost as much as unscaled on llama-tiny (docs/benchmarks/2026-11-30-scaled-codecs.md).

Error feedback's residuals are kept in the gradient's units: divided by this step's scale before the exchange and
multiplied back after. The scale follows the gradient from step to step, and a residual re-read at another scale
would no longer be what the gradient lost. So checkpoints hold unscaled residuals, and a resume may change
`compression.scale`. On llama-tiny at dp=2 the sign codec went from +6.75 % of the exact run's eval loss (by rows)
and +4.55 % (by columns) to +2.31 % (docs/benchmarks/2026-11-30-scaled-codecs.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.compression.codecs import TwoPhaseState, chunk_len, two_phase_mean
from hybrid.compression.layout import bucket_spans, transpose_spans
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

SCALES = ("auto", "factored", "none")
FACTORED = ("int8", "int4", "sign")  # the gradient exchanges `factored` applies to (`config_sync.SCALED_CODECS`)
AUTO = frozenset({"sign"})  # the methods `auto` scales: measured to gain
FLOOR = 1e-3  # a scale's floor, as a fraction of its matrix's mean scale
Matrix = tuple[int, int, int]  # (offset in the flat bucket, rows, cols) of a gradient `matrices` scales


def scaled(cfg: CompressionConfig, method: str) -> bool:
    """Whether `method`'s exchange runs on scaled values under `cfg` (the `compression` config)."""
    return method in FACTORED and (cfg.scale == "factored" or (cfg.scale == "auto" and method in AUTO))


def run_scaled(cfg: CompressionConfig) -> bool:
    """Whether the run's DP exchange codes scaled values: its method's, or hierarchical's inner method's."""
    return scaled(cfg, cfg.inner if cfg.method == "hierarchical" else cfg.method)


def phrase(cfg: CompressionConfig) -> str:
    """The start-up line's words for the scale, where the run codes scaled values (`run_scaled`)."""
    if not run_scaled(cfg):
        return ""
    return ("; each gradient matrix coded divided by its factored scale (its rows' and columns' magnitudes, "
            "rows + cols floats more per matrix; compression.scale=none codes it as it is)")


def matrices(shapes: Sequence[Sequence[int]]) -> list[Matrix]:
    """Where the matrices among gradients of `shapes` (packed in order from offset 0) lie, each as rows × the
    rest: two or more dimensions, more than one row and column (a vector's factored estimate would be its own
    magnitude, sent in full: hierarchical's pieces of a bias are (k, 1))."""
    out, at = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2 and numel and 1 < shape[0] < numel:
            out.append((at, shape[0], numel // shape[0]))
        at += numel
    return out


def stats_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """Counted payload of the statistics' all-reduce for one bucket of gradients of `shapes`: 4·Σ(rows + cols)."""
    return 4 * sum(rows + cols for _, rows, cols in matrices(shapes))


def factored_scale(buf: torch.Tensor, shapes: Sequence[Sequence[int]], group: Group) -> Optional[torch.Tensor]:
    """The flat scale of the bucket `buf` holding gradients of `shapes`: each matrix's factored estimate from the
    DP mean of its rows' and columns' mean squares (one fp32 all-reduce of them over `group`), 1 elsewhere;
    None when the bucket holds no matrix."""
    mats = matrices(shapes)
    if not mats:
        return None
    squares = (buf[at: at + rows * cols].view(rows, cols).pow(2) for at, rows, cols in mats)  # one at a time
    stats = torch.cat([torch.cat([sq.mean(1), sq.mean(0)]) for sq in squares])
    C.all_reduce(stats, group)
    stats /= C.size(group)
    scale = torch.ones_like(buf)
    at = 0
    for offset, rows, cols in mats:
        scale[offset: offset + rows * cols] = _outer(stats[at: at + rows], stats[at + rows: at + rows + cols])
        at += rows + cols
    return scale


def _outer(row_sq: torch.Tensor, col_sq: torch.Tensor) -> torch.Tensor:
    """√(Rᵢ·Cⱼ / mean R), floored at FLOOR × its mean; 1 where the matrix is zero (no host read: CUDA-safe)."""
    s = (torch.outer(row_sq, col_sq) / row_sq.mean().clamp_min(1e-30)).sqrt()
    s = s + FLOOR * s.mean()
    return torch.where(s.mean() > 0, s, torch.ones_like(s)).reshape(-1)


def scaled_mean(st: TwoPhaseState, buf: torch.Tensor, idx: int, scale: torch.Tensor) -> torch.futures.Future:
    """`codecs.two_phase_mean` of `buf` / `scale`, multiplied back by `scale` (both laid out alike, as the
    exchange and its residuals see them): the residuals of `idx` are divided by the scale before and multiplied
    back after, so that they are kept unscaled across steps."""
    buf.div_(scale)
    _rescale(st, idx, scale, buf.numel(), torch.Tensor.div_)

    def unscale(fut: torch.futures.Future) -> torch.Tensor:
        fut.value().mul_(scale)
        _rescale(st, idx, scale, buf.numel(), torch.Tensor.mul_)
        return fut.value()

    return two_phase_mean(st, buf, idx).then(unscale)


def _rescale(st: TwoPhaseState, idx: int, scale: torch.Tensor, numel: int, op: Any) -> None:
    """Apply `op` (in place) by `scale` to bucket `idx`'s worker residual and by its slice for this rank's chunk
    to the server residual (the padding of either is zero and stays so)."""
    worker, server = st.worker.get(idx), st.server.get(idx)
    if worker is not None and worker.numel() >= numel:
        op(worker[:numel], scale)
    if server is not None:
        start = C.rank(st.group) * chunk_len(st.codec, numel, C.size(st.group))
        part = scale[start: start + server.numel()]
        op(server[: part.numel()], part)


@dataclass
class FactoredState(TwoPhaseState):
    """A two-phase gradient method's state with its exchange on factored-scaled values (`factored_hook`);
    `columns`: row-parallel weights laid out column by column as well (`layout.py`)."""

    columns: bool = False


def factored_hook(st: FactoredState, bucket: Any) -> torch.futures.Future:
    """The two-phase exchange of `bucket` on its gradients divided by their factored scale (see module doc),
    laid out column by column where `st.columns` (the scale laid out with them)."""
    buf, idx = bucket.buffer(), bucket.index()
    if C.size(st.group) == 1:
        return two_phase_mean(st, buf, idx)
    spans = bucket_spans(bucket) if st.columns else []
    scale = factored_scale(buf, [tuple(g.shape) for g in bucket.gradients()], st.group)
    transpose_spans(buf, spans)
    if scale is None:
        fut = two_phase_mean(st, buf, idx)
    else:
        transpose_spans(scale, spans)
        fut = scaled_mean(st, buf, idx, scale)

    def restore(f: torch.futures.Future) -> torch.Tensor:
        transpose_spans(f.value(), spans, back=True)
        return f.value()

    return fut.then(restore) if spans else fut
