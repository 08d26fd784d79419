"""The TP linears' autograd Functions, under each overlap mode (`TPOverlap`; the exchanges in `tp/comm.py`).

Column-parallel, whole input (`_CopyLinear`): forward x Wᵀ + b; backward the input gradient x̄ = ḡ W is all-reduced
(`copy_to_region`'s exchange) — launched before the weight-gradient GEMM and waited for after it under bulk
(picotron's overlap), blocking under none.

Column-parallel under SP (`_SequenceParallelLinear`): forward all-gathers the sequence chunk and multiplies —
under chunked, piece by piece around the ring, each piece's GEMM while the next travels. Only the chunk is saved;
the backward gathers it again (op "regather") for the weight gradient and reduce-scatters the input gradient.
Bulk (and chunked), when one backward wants both: the regather launched, the input-gradient GEMM while it travels;
the reduce-scatter launched, the weight-gradient GEMM while it travels (Megatron's bulk overlap). A zero-bubble
split backward's input pass (the input gradient only) reduce-scatters it around the ring under chunked, and its
weight pass regathers around the ring, adding each piece's product to W's gradient as it arrives.

Row-parallel under SP and chunked (`_RowSequenceLinear`): forward the partial products of each piece of the
sequence made while the running sums travel (GEMM → reduce-scatter); backward the output gradient all-gathered
around the ring, each piece's input-gradient GEMM while the next travels, then the weight gradient from the
gathered gradient (a split backward's input pass keeps it for its weight pass: no second gather). Its `act`
(selective recomputation's `act_linear`) runs on each piece and again in the backward. The embedding's
reduce-scatter under SP and chunked (`_SequenceEmbedding`) is the same ring with each piece's lookup as its
partial; its backward gathers the gradient around the ring, adding each piece's rows to W's gradient.

Every Function asks `split_backward.needed` which gradients the running backward wants; bulk and none run the
same GEMMs in the same order (bit for bit equal); chunked splits them by pieces (equal within rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.pp.split_backward import edges_of, needed
from hybrid.parallel.tp.comm import (
    TPOverlap,
    gather_each,
    reduce_scatter_each,
    start_all_reduce,
    start_gather_seq,
    start_reduce_scatter_seq,
)

Act = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ḡᵀ x over every token: a linear layer's weight gradient."""
    return g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def _bgrad(g: torch.Tensor) -> torch.Tensor:
    """Σ ḡ over every token: a linear layer's bias gradient."""
    return g.reshape(-1, g.shape[-1]).sum(0)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """A piece of the sequence (dim 1)."""
    return t[:, rows]


def _keep(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Group,  # noqa: ANN001
          overlap: TPOverlap) -> None:
    """What a column linear's backward reads: x and W saved (through `save_for_backward`, so outer saved-tensor hooks
    stay in charge), the group, the overlap mode, whether there is a bias, the gradient edges (`needed`)."""
    ctx.group, ctx.has_bias, ctx.overlap = group, bias is not None, overlap
    ctx.save_for_backward(x, weight)
    ctx.edges = edges_of(x, weight, bias)


class _CopyLinear(torch.autograd.Function):
    """x (whole on every TP rank) → x Wᵀ + b; backward all-reduces x̄ (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: ANN001
                group: Group, overlap: TPOverlap) -> torch.Tensor:
        _keep(ctx, x, weight, bias, group, overlap)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = needed(ctx.needs_input_grad[:3], ctx.edges)
        grad_x = g.matmul(weight) if need_x else None
        pending = start_all_reduce(grad_x, ctx.group) if need_x and ctx.overlap.bulk else None
        if need_x and pending is None:
            C.all_reduce(grad_x, ctx.group)
        grad_w = _wgrad(g, x) if need_w else None
        grad_b = _bgrad(g) if need_b and ctx.has_bias else None
        return pending.wait() if pending else grad_x, grad_w, grad_b, None, None


class _SequenceParallelLinear(torch.autograd.Function):
    """x_chunk → all-gather along the sequence → x Wᵀ + b; only the chunk is saved (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: ANN001
                group: Group, overlap: TPOverlap) -> torch.Tensor:
        _keep(ctx, x, weight, bias, group, overlap)
        if overlap.chunked:
            return gathered_linear(x, weight, bias, group, overlap.lanes(C.size(group)))
        return F.linear(C.all_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = needed(ctx.needs_input_grad[:3], ctx.edges)  # a split backward's pass
        grad_b = _bgrad(g) if need_b and ctx.has_bias else None
        grad_x, grad_w = _column_grads(x, weight, g, ctx.group, ctx.overlap, (need_x, need_w))
        return grad_x, grad_w, grad_b, None, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Group,
                    lanes: int) -> torch.Tensor:
    """x Wᵀ + b over the whole sequence gathered from every rank's chunk x, each piece's GEMM while the next piece
    travels the ring."""
    y = x.new_empty(x.shape[0], x.shape[1] * C.size(group), weight.shape[0])

    def use(piece: torch.Tensor, rows: slice) -> None:
        into = _rows(y, rows)
        if not into.is_contiguous():  # b > 1: the piece's rows are strided in y
            into.copy_(F.linear(piece, weight, bias))
            return
        torch.matmul(piece, weight.t(), out=into)  # one sequence: the GEMM writes its rows of y in place
        if bias is not None:
            into.add_(bias)

    gather_each(x, group, use, "all_gather", lanes)
    return y


def _column_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, group: Group, overlap: TPOverlap,
                  want: tuple[bool, bool]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(x̄ reduce-scattered to this rank's chunk, W̄) of a sequence-parallel column linear, where `want`ed."""
    if all(want) and overlap.bulk:
        return _bulk_column_grads(x, w, g, group)
    lanes = overlap.lanes(C.size(group))
    if overlap.chunked and want[0]:  # a split backward's input pass
        return reduce_scatter_each(lambda rows: _rows(g, rows).matmul(w), g.shape[1], group, lanes), None
    if overlap.chunked and want[1]:  # … and its weight pass
        return None, _ring_wgrad(g, x, group, lanes, "regather").to(g.dtype)
    grad_w = _wgrad(g, C.all_gather_seq(x, group, op="regather")) if want[1] else None
    return C.reduce_scatter_seq(g.matmul(w), group) if want[0] else None, grad_w


def _bulk_column_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, group: Group
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The regather behind the input-gradient GEMM, the input gradient's reduce-scatter behind the weight's."""
    gathering = start_gather_seq(x, group, "regather")
    grad_x = g.matmul(w)
    full = gathering.wait()
    scattering = start_reduce_scatter_seq(grad_x, group)
    grad_w = _wgrad(g, full)
    return scattering.wait(), grad_w


def _ring_wgrad(g: torch.Tensor, x: torch.Tensor, group: Group, lanes: int, op: str) -> torch.Tensor:
    """Σ over the pieces of ḡ_pieceᵀ x_piece in fp32, x's pieces gathered around the ring as they are used."""
    grad_w = torch.zeros(g.shape[-1], x.shape[-1], dtype=torch.float32, device=x.device)

    def use(piece: torch.Tensor, rows: slice) -> None:
        grad_w.add_(_wgrad(_rows(g, rows), piece))

    gather_each(x, group, use, op, lanes)
    return grad_w


class _RowSequenceLinear(torch.autograd.Function):
    """x [b, s, in/tp] → reduce-scatter of act(x) Wᵀ to this rank's [b, s/tp, out], piece by piece around the ring
    (see the module doc); x (not act(x)) is saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, act: Act, group: Group,  # noqa: ANN001
                lanes: int) -> torch.Tensor:
        ctx.act, ctx.group, ctx.lanes, ctx.kept = act, group, lanes, None
        ctx.save_for_backward(x, weight)
        ctx.edges = edges_of(x, weight)
        return reduce_scatter_each(lambda rows: F.linear(_applied(act, _rows(x, rows)), weight), x.shape[1], group,
                                   lanes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        need_x, need_w = needed(ctx.needs_input_grad[:2], ctx.edges)
        grad_x, full = _row_input_grad(ctx, x, weight, g) if need_x else (None, ctx.kept)
        ctx.kept = full if need_x and not need_w else None  # the weight pass's gradient, gathered once
        if not need_w:
            return grad_x, None, None, None, None
        full = full if full is not None else C.all_gather_seq(g, ctx.group)
        return grad_x, _wgrad(full, _applied(ctx.act, x)), None, None, None


def _applied(act: Act, x: torch.Tensor) -> torch.Tensor:
    return x if act is None else act(x)


def _row_input_grad(ctx, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor  # noqa: ANN001
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̄, the gathered ḡ): ḡ's pieces gathered around the ring, each piece's GEMM ḡ_piece W as the next travels,
    then back through `act`."""
    full = g.new_empty(g.shape[0], g.shape[1] * C.size(ctx.group), g.shape[2])
    grad_a = g.new_empty(*x.shape[:2], w.shape[1])

    def use(piece: torch.Tensor, rows: slice) -> None:
        _rows(full, rows).copy_(piece)
        _rows(grad_a, rows).copy_(piece.matmul(w))

    gather_each(g, ctx.group, use, "all_gather", ctx.lanes)
    if ctx.act is None:
        return grad_a, full
    with torch.enable_grad():
        h = x.detach().requires_grad_()
        return torch.autograd.grad(ctx.act(h), h, grad_a)[0], full


def copy_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Group,
                overlap: TPOverlap) -> torch.Tensor:
    """x Wᵀ + b with x whole on every TP rank, x̄ all-reduced in the backward (behind W̄'s GEMM under bulk)."""
    return _CopyLinear.apply(x, weight, bias, group, overlap)


def sequence_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Group,
                    overlap: TPOverlap) -> torch.Tensor:
    """x Wᵀ + b of this rank's sequence chunk x, gathered along the sequence (around the ring under chunked)."""
    return _SequenceParallelLinear.apply(x, weight, bias, group, overlap)


def row_sequence_linear(x: torch.Tensor, weight: torch.Tensor, act: Act, group: Group, lanes: int) -> torch.Tensor:
    """act(x) Wᵀ reduce-scattered along the sequence, pipelined around the TP ring (chunked overlap)."""
    return _RowSequenceLinear.apply(x, weight, act, group, lanes)


class _SequenceEmbedding(torch.autograd.Function):
    """ids [b, s] → the reduce-scatter of this rank's vocabulary rows' lookup to [b, s/tp, h], piece by piece. Saves
    what the blocking lookup saves: the ids as rows of this rank's shard and where they are here."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, start: int, group: Group,  # noqa: ANN001
                lanes: int) -> torch.Tensor:
        ctx.group, ctx.lanes, ctx.rows, ctx.dtype = group, lanes, weight.shape[0], weight.dtype
        inside = (ids >= start) & (ids < start + weight.shape[0])
        local = (ids - start).masked_fill(~inside, 0)
        ctx.save_for_backward(local, inside)

        def lookup(rows: slice) -> torch.Tensor:
            return F.embedding(local[:, rows], weight).masked_fill(~inside[:, rows].unsqueeze(-1), 0.0)

        return reduce_scatter_each(lookup, ids.shape[1], group, lanes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        local, inside = ctx.saved_tensors
        grad_w = torch.zeros(ctx.rows, g.shape[-1], dtype=torch.float32, device=g.device)

        def use(piece: torch.Tensor, rows: slice) -> None:
            here = inside[:, rows]
            grad_w.index_add_(0, local[:, rows][here], piece[here].float())

        gather_each(g, ctx.group, use, "all_gather", ctx.lanes)
        return grad_w.to(ctx.dtype), None, None, None, None


def sequence_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, group: Group, lanes: int
                       ) -> torch.Tensor:
    """The vocab-parallel embedding's lookup reduce-scattered along the sequence around the TP ring (chunked)."""
    return _SequenceEmbedding.apply(weight, ids, start, group, lanes)
