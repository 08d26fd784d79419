"""Megatron tensor-parallel layers, each handed its TP group explicitly.

ColumnParallelLinear splits the output features across TP ranks (input copied in: all-reduce
of the input gradient backward); RowParallelLinear splits the input features (partial outputs
all-reduced forward; bias added once after the reduction). VocabParallelEmbedding splits the
(padded) vocabulary; `vocab_parallel_cross_entropy` computes the loss on vocab-split logits
with three small all-reduces instead of gathering them. At tp=1 every layer is the plain
layer and no collective runs.

Sequence parallelism (`sequence_parallel=True`): outside the TP regions activations are
[b, s/tp, h] chunks. A column-parallel layer all-gathers its input along the sequence
(reduce-scatter of the input gradient backward) instead of copying it in; a row-parallel
layer and the embedding reduce-scatter their partial sums along the sequence (all-gather
backward) instead of all-reducing them: the same ring volume (an all-reduce is a
reduce-scatter plus an all-gather), plus one re-gather per column-parallel input in backward,
while norms, residuals and dropout hold 1/tp of the sequence. Replicated parameters used on
sequence chunks (norms, row-parallel biases, positions) get partial gradients on each TP
rank, summed by `grads.sync_sequence_parallel_grads` once per step.

Under autocast, a column-parallel layer casts its input to the autocast dtype *before* the
region op, so the TP exchanges of the input (and of its gradient) run in bf16, as the
row-parallel outputs do.

How the exchanges meet the GEMMs — blocking, the backward's launched early (bulk), or pipelined around the TP
ring a piece of the sequence at a time (chunked) — is `parallel.tp_overlap`, set on each layer's `overlap`
(`CausalLM.set_tp_overlap`); the autograd Functions of each mode are `hybrid.parallel.tp.overlap`'s.

Every parameter these layers make carries its `ParamInfo` record (`hybrid.parallel.params`):
its global shape and TP `Shard`, its `Init`, and whether it lives on sequence chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.params import Init, Shard, annotate, param_info
from hybrid.parallel.recompute import act_linear
from hybrid.parallel.tp.comm import TPOverlap
from hybrid.parallel.tp.overlap import copy_linear, row_sequence_linear, sequence_embedding, sequence_linear


def _split_parts(parts: Sequence[int], tp: int, what: str) -> int:
    for n in parts:
        if n % tp:
            raise ValueError(f"{what}: {n} features do not divide by tp={tp}")
    return sum(parts) // tp


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Group,
                  sequence_parallel: bool = False, overlap: TPOverlap = TPOverlap()) -> torch.Tensor:
    """x Wᵀ + b for a weight split along its output rows.

    Without SP: x is whole on every rank; backward all-reduces x's gradient (copy_to_region's exchange).
    With SP: x is this rank's sequence chunk; forward all-gathers it along the sequence and
    backward reduce-scatters its gradient. As in Megatron, only the chunk is kept for the
    weight gradient: backward all-gathers it again (counted as op "regather"), trading one
    more all-gather for 1/tp of the layer's saved input. `overlap`: how these exchanges meet the GEMMs
    (`hybrid.parallel.tp.overlap`).
    """
    if C.size(group) == 1:
        return F.linear(x, weight, bias)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if sequence_parallel:
        check_sequence_chunk(x)
    with torch.autocast(x.device.type, enabled=False):
        if not sequence_parallel:
            return copy_linear(x, weight, bias, group, overlap)
        return sequence_linear(x, weight, bias, group, overlap)


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """A TP linear's inputs in the autocast dtype when autocast is on for their device (cast outside, and
    differentiably, so the exchange and the multiply both run in that dtype); None stays None."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def check_sequence_chunk(x: torch.Tensor) -> None:
    """A sequence-parallel input is this rank's [batch, seq/tp, features] chunk."""
    if x.dim() != 3:
        raise ValueError(f"sequence-parallel input must be [batch, seq/tp, features], got shape {tuple(x.shape)}")


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split across TP ranks (see `column_linear` for the
    collectives with and without sequence parallelism). `gather_output=True` all-gathers y
    along the last dim.
    """

    def __init__(self, in_features: int, out_parts: Sequence[int], group: Group, bias: bool = True,
                 std: float = 0.02, gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.overlap = TPOverlap()  # `CausalLM.set_tp_overlap` (parallel.tp_overlap)
        tp, r = C.size(group), C.rank(group)
        out = _split_parts(out_parts, tp, "ColumnParallelLinear")
        self.local_parts = [n // tp for n in out_parts]
        shard = Shard(0, tuple(out_parts), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(out, in_features)), Init("normal", std), shard)
        self.bias = annotate(nn.Parameter(torch.empty(out)), Init("zeros"), shard) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_linear(x, self.weight, self.bias, self.group, self.sequence_parallel, self.overlap)
        if not self.gather_output or C.size(self.group) == 1:
            return y
        ranks = C.gather_from_region(y, self.group).chunk(C.size(self.group), dim=-1)
        if len(self.local_parts) == 1:
            return torch.cat(ranks, dim=-1)
        per_rank = [r.split(self.local_parts, dim=-1) for r in ranks]  # [p0_r p1_r …] → [p0 | p1 | …]
        return torch.cat([torch.cat([r[i] for r in per_rank], dim=-1) for i in range(len(self.local_parts))], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split; x arrives already split (from a column layer).

    Forward: all-reduce of the partial products over the TP group, then the bias once.
    Backward: identity (each rank's gradient of y is the full gradient). With sequence
    parallelism the all-reduce becomes a reduce-scatter along the sequence (all-gather of the
    gradient backward), and the bias is added to this rank's sequence chunk; under chunked overlap both are
    pipelined with the GEMMs around the TP ring (`hybrid.parallel.tp.overlap.row_sequence_linear`).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 std: float = 0.02, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap = TPOverlap()  # `CausalLM.set_tp_overlap` (parallel.tp_overlap)
        tp, r = C.size(group), C.rank(group)
        local_in = _split_parts([in_features], tp, "RowParallelLinear")
        shard = Shard(1, (in_features,), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(out_features, local_in)), Init("normal", std), shard)
        param_info(self.weight).column_blocks = True  # its input channels set its gradient's scale
        self.bias = None
        if bias:
            self.bias = annotate(nn.Parameter(torch.empty(out_features)), Init("zeros"),
                                 sequence_parallel=sequence_parallel and tp > 1)

    def forward(self, x: torch.Tensor, act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """`act`: apply it to `x` first, keeping `x` rather than `act(x)` for the backward (`act_linear`)."""
        if self.sequence_parallel and self.overlap.chunked and C.size(self.group) > 1:
            return self._ring(x, act)
        y = F.linear(x, self.weight) if act is None else act_linear(x, self.weight, act)
        if self.sequence_parallel:
            y = C.reduce_scatter_to_sequence(y, self.group)
        else:
            y = C.reduce_from_region(y, self.group)
        return y + self.bias if self.bias is not None else y

    def _ring(self, x: torch.Tensor, act: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """The GEMM and its reduce-scatter pipelined around the TP ring, in the autocast dtype where it is on."""
        x, weight = autocast_inputs(x, self.weight)
        with torch.autocast(x.device.type, enabled=False):
            y = row_sequence_linear(x, weight, act, self.group, self.overlap.lanes(C.size(self.group)))
        return y + self.bias if self.bias is not None else y


def padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of `multiple · tp` (Megatron's padding)."""
    m = multiple * tp
    return (vocab + m - 1) // m * m


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the padded vocabulary's rows split across TP ranks.

    Each rank looks up the ids in its row range (others give zeros); an all-reduce over the
    TP group forward sums the pieces into the full embedding. Backward: identity. With
    sequence parallelism a reduce-scatter along the sequence replaces the all-reduce (each
    rank keeps its [b, s/tp, h] chunk; all-gather of the gradient backward), pipelined with the
    lookups around the TP ring under chunked overlap.
    """

    def __init__(self, padded_vocab_size: int, hidden: int, group: Group, std: float = 0.02,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap = TPOverlap()  # `CausalLM.set_tp_overlap` (parallel.tp_overlap)
        tp, r = C.size(group), C.rank(group)
        rows = _split_parts([padded_vocab_size], tp, "VocabParallelEmbedding")
        self.start, self.end = r * rows, (r + 1) * rows
        shard = Shard(0, (padded_vocab_size,), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(rows, hidden)), Init("normal", std), shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.size(self.group) == 1:
            return F.embedding(ids, self.weight)
        if self.sequence_parallel and self.overlap.chunked:  # lookups and reduce-scatter around the TP ring
            return sequence_embedding(self.weight, ids, self.start, self.group, self.overlap.lanes(C.size(self.group)))
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return C.reduce_scatter_to_sequence(out, self.group)
        return C.reduce_from_region(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy on logits split along the vocabulary, never gathering them.

    Forward: all-reduce MAX of the row maxima, all-reduce SUM of the target logit (found on
    exactly one rank) and of Σ exp — three reductions of b·s elements each.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, start: int,  # noqa: ANN001
                vocab: int) -> torch.Tensor:
        logits = logits.float()
        n_local = logits.shape[-1]
        pad = torch.arange(start, start + n_local, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
        row_max = logits.max(dim=-1).values
        C.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + n_local)
        local_t = (target - start).masked_fill(outside, 0)
        tgt = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        C.all_reduce(tgt, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group)
        loss = sum_exp.log() - tgt
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron: a b·s·V/tp copy saved; a second backward is not supported
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy; padded vocabulary entries (≥ vocab_size) never count."""
    if C.size(group) == 1:
        return F.cross_entropy(logits[..., :vocab_size].flatten(0, -2).float(), target.flatten())
    start = C.rank(group) * logits.shape[-1]
    return _VocabParallelCE.apply(logits, target, group, start, vocab_size).mean()
