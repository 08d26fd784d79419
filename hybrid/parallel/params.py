"""What hybrid knows about a parameter beyond its tensor: one `ParamInfo` record on each, `p.hybrid`.

Every parameter carries its *global* identity: how this TP rank's tensor is cut from the global one
(`Shard`), how the global tensor is initialised (`Init`), and the flags that decide where its
gradient is summed and where it is counted once:

- `shard`: None for a TP-replicated parameter (norms, row-parallel biases, positions);
- `parts`: the fused parts along the split dim (Q|K|V, gate|up), kept at tp=1 too, so checkpoint
  keys never depend on tp;
- `sequence_parallel`: its gradient is a partial sum over this rank's sequence chunk (summed over TP
  once per step by `grads.sync_sequence_parallel_grads`);
- `pp_tied` / `pp_duplicate`: a tied embedding split between the first and last pipeline stage
  (gradients summed over the embedding group); the last stage's copy is the duplicate, counted once
  in norms and sizes and never saved;
- `column_blocks`: a row-parallel weight, whose gradient's scale follows its input channels: block codecs
  take it column by column (`hybrid.compression.layout`).

`param_info(p)` reads the record; a plain torch parameter is a replicated one. Layout-independent
initialisation: `init_parameters` generates each full global tensor from a generator seeded by
(seed, global name) and keeps this rank's slice, so tp=1 and tp=4 start from the same model.
`full_tensor` is the inverse of the slice: an all-gather over the TP group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.rng import derive_seed


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


@dataclass
class ParamInfo:
    """The record `p.hybrid` of a parameter built by hybrid (see the module docstring)."""

    init: Optional[Init] = None
    shard: Optional[Shard] = None
    parts: Optional[tuple[int, tuple[int, ...]]] = None
    sequence_parallel: bool = False
    pp_tied: bool = False
    pp_duplicate: bool = False
    column_blocks: bool = False

    @property
    def tp_duplicate(self) -> bool:
        """Replicated over TP: every TP rank holds the same tensor (counted on TP rank 0 only)."""
        return self.shard is None


def param_info(p: torch.Tensor) -> ParamInfo:
    """`p`'s record; a parameter hybrid did not build (plain torch) is replicated and unflagged."""
    info = getattr(p, "hybrid", None)
    return info if info is not None else ParamInfo()


def annotate(p: nn.Parameter, init: Init, shard: Optional[Shard] = None,
             sequence_parallel: bool = False) -> nn.Parameter:
    """Attach `p`'s record: its init, its TP shard (None at tp=1), its fused parts (kept at tp=1 too)."""
    p.hybrid = ParamInfo(init=init, shard=shard if shard is not None and shard.size > 1 else None,
                         parts=(shard.dim, shard.parts) if shard is not None else None,
                         sequence_parallel=sequence_parallel)
    return p


def global_shape(p: nn.Parameter) -> tuple[int, ...]:
    shard = param_info(p).shard
    if shard is None:
        return tuple(p.shape)
    shape = list(p.shape)
    shape[shard.dim] = sum(shard.parts)
    return tuple(shape)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, names: Optional[dict[str, nn.Parameter]] = None) -> None:
    """Initialise every parameter from its global name's seed, then slice to this rank."""
    for name, p in (names or dict(module.named_parameters())).items():
        info = param_info(p)
        if info.init.kind == "zeros":
            p.zero_()
            continue
        if info.init.kind == "ones":
            p.fill_(1.0)
            continue
        gen = torch.Generator().manual_seed(derive_seed(seed, name))
        full = torch.empty(global_shape(p), dtype=torch.float32).normal_(0.0, info.init.std, generator=gen)
        p.copy_(info.shard.slice(full) if info.shard is not None else full)


@torch.no_grad()
def full_tensor(p: torch.Tensor, group: Group) -> torch.Tensor:
    """The global tensor of a TP-sharded parameter (the inverse of `Shard.slice`): every rank's
    shard all-gathered over the TP group, then each part re-assembled. Replicated: a copy.
    Export and checkpoint conversion: counted under op "gather_params"."""
    shard = param_info(p).shard
    if shard is None:
        return p.detach().clone()
    pieces = [torch.empty_like(p) for _ in range(shard.size)]
    dist.all_gather(pieces, p.detach().contiguous(), group=group)
    local = [n // shard.size for n in shard.parts]
    per_rank = [t.split(local, dim=shard.dim) for t in pieces]
    full = torch.cat([torch.cat([r[i] for r in per_rank], dim=shard.dim) for i in range(len(local))], dim=shard.dim)
    C.count(group, "gather_params", full)
    return full


def full_state_dict(module: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """{global name: global tensor} of every parameter of `module`; a collective over `group`."""
    return {name: full_tensor(p, group) for name, p in module.named_parameters()}


def count_params(params: Iterable[nn.Parameter], tp_rank: int, groups: Sequence[Group]) -> int:
    """Parameters of the whole model: the local count (a TP-replicated parameter on TP rank 0 only, a pipeline
    duplicate nowhere) summed over `groups` (TP, PP) by one all-reduce each: start-up bookkeeping, uncounted."""
    local = sum(p.numel() for p in params
                if not param_info(p).pp_duplicate and (not param_info(p).tp_duplicate or tp_rank == 0))
    n = torch.tensor(float(local))
    for g in groups:
        if C.size(g) > 1:
            dist.all_reduce(n, group=g)
    return int(n.item())
