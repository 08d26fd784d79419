"""Megatron tensor-parallel layers, each handed its TP group explicitly.

ColumnParallelLinear splits the output features across TP ranks (input copied in: all-reduce
of the input gradient backward); RowParallelLinear splits the input features (partial outputs
all-reduced forward; bias added once after the reduction). VocabParallelEmbedding splits the
(padded) vocabulary; `vocab_parallel_cross_entropy` computes the loss on vocab-split logits
with three small all-reduces instead of gathering them. At tp=1 every layer is the plain
layer and no collective runs.

Layout-independent initialisation: every parameter carries its *global* shape, how it is
sliced (`Shard`) and how it is initialised (`Init`). `init_parameters` generates each full
global tensor from a generator seeded by (seed, global name) and keeps this rank's slice,
so tp=1 and tp=4 start from the same model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group


@dataclass(frozen=True)
class Shard:
    """How a TP rank's tensor is cut from the global one.

    `dim` is split; along it the global tensor is a concatenation of `parts` (e.g. Q, K, V
    rows of a fused projection), and each part is split evenly so every rank holds whole
    heads of each part.
    """

    dim: int
    parts: tuple[int, ...]
    rank: int
    size: int

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        pieces = full.split(list(self.parts), dim=self.dim)
        return torch.cat([p.chunk(self.size, dim=self.dim)[self.rank] for p in pieces], dim=self.dim)


@dataclass(frozen=True)
class Init:
    kind: str  # normal | zeros | ones
    std: float = 0.0


def annotate(p: nn.Parameter, init: Init, shard: Optional[Shard] = None) -> nn.Parameter:
    """Attach init and shard descriptions; `tp_duplicate` marks a TP-replicated parameter."""
    p.hybrid_init = init
    p.hybrid_shard = shard if shard is not None and shard.size > 1 else None
    p.tp_duplicate = p.hybrid_shard is None
    return p


def global_shape(p: nn.Parameter) -> tuple[int, ...]:
    shard = getattr(p, "hybrid_shard", None)
    if shard is None:
        return tuple(p.shape)
    shape = list(p.shape)
    shape[shard.dim] = sum(shard.parts)
    return tuple(shape)


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, names: Optional[dict[str, nn.Parameter]] = None) -> None:
    """Initialise every parameter from its global name's seed, then slice to this rank."""
    for name, p in (names or dict(module.named_parameters())).items():
        init: Init = p.hybrid_init
        if init.kind == "zeros":
            p.zero_()
            continue
        if init.kind == "ones":
            p.fill_(1.0)
            continue
        gen = torch.Generator().manual_seed(_seed(seed, name))
        full = torch.empty(global_shape(p), dtype=torch.float32).normal_(0.0, init.std, generator=gen)
        shard = p.hybrid_shard
        p.copy_(shard.slice(full) if shard is not None else full)


def _split_parts(parts: Sequence[int], tp: int, what: str) -> int:
    for n in parts:
        if n % tp:
            raise ValueError(f"{what}: {n} features do not divide by tp={tp}")
    return sum(parts) // tp


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split across TP ranks.

    Forward: identity on x (every rank has it). Backward: all-reduce of x's gradient over
    the TP group, since each rank contributed the gradient of its own output slice.
    `gather_output=True` all-gathers y along the last dim.
    """

    def __init__(self, in_features: int, out_parts: Sequence[int], group: Group, bias: bool = True,
                 std: float = 0.02, gather_output: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        tp, r = C.size(group), C.rank(group)
        out = _split_parts(out_parts, tp, "ColumnParallelLinear")
        shard = Shard(0, tuple(out_parts), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(out, in_features)), Init("normal", std), shard)
        self.bias = annotate(nn.Parameter(torch.empty(out)), Init("zeros"), shard) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(C.copy_to_region(x, self.group), self.weight, self.bias)
        return C.gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split; x arrives already split (from a column layer).

    Forward: all-reduce of the partial products over the TP group, then the bias once.
    Backward: identity (each rank's gradient of y is the full gradient).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 std: float = 0.02) -> None:
        super().__init__()
        self.group = group
        tp, r = C.size(group), C.rank(group)
        local_in = _split_parts([in_features], tp, "RowParallelLinear")
        shard = Shard(1, (in_features,), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(out_features, local_in)), Init("normal", std), shard)
        self.bias = annotate(nn.Parameter(torch.empty(out_features)), Init("zeros")) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = C.reduce_from_region(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of `multiple · tp` (Megatron's padding)."""
    m = multiple * tp
    return (vocab + m - 1) // m * m


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the padded vocabulary's rows split across TP ranks.

    Each rank looks up the ids in its row range (others give zeros); an all-reduce over the
    TP group forward sums the pieces into the full embedding. Backward: identity.
    """

    def __init__(self, padded_vocab_size: int, hidden: int, group: Group, std: float = 0.02) -> None:
        super().__init__()
        self.group = group
        tp, r = C.size(group), C.rank(group)
        rows = _split_parts([padded_vocab_size], tp, "VocabParallelEmbedding")
        self.start, self.end = r * rows, (r + 1) * rows
        shard = Shard(0, (padded_vocab_size,), r, tp)
        self.weight = annotate(nn.Parameter(torch.empty(rows, hidden)), Init("normal", std), shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
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
        grad = softmax
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
