"""Counted collectives and the autograd-aware TP region ops, each taking an explicit group.

Every collective in hybrid goes through `all_reduce` / `all_gather_into` / … below, which
record (op, elements, dtype, group name) in a `CommCounter`, so tests and metrics read the
exact bytes moved per group instead of estimating them. A `None` group or a group of size
one means "no communication": the op is the identity and nothing is recorded.

Region ops (Megatron's f/g conjugate pairs):
  copy_to_region      forward identity,          backward all-reduce   (entering column-parallel)
  reduce_from_region  forward all-reduce,        backward identity     (leaving row-parallel)
  gather_from_region  forward all-gather (last), backward split        (gathering logits/outputs)
  split_to_region     forward split (last),      backward all-gather
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


@dataclass
class CommCounter:
    """Bytes and calls per (group name, op), accumulated until `reset()`.

    Bytes are the payload handed to the collective: elements × dtype size.
    """

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, name: str, op: str, tensor: torch.Tensor) -> None:
        self.bytes[(name, op)] += tensor.numel() * tensor.element_size()
        self.calls[(name, op)] += 1

    def group_bytes(self, name: str) -> int:
        return sum(b for (g, _), b in self.bytes.items() if g == name)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


COUNTER = CommCounter()
"""The process-wide tally. Not configuration: a meter read by metrics and tests."""

_GROUP_NAMES: dict[int, str] = {}


def name_group(group: Group, name: str) -> None:
    """Attach a name (tp, dp, pp, dp_intra, …) under which the group's traffic is counted."""
    if group is not None:
        _GROUP_NAMES[id(group)] = name


def group_name(group: Group) -> str:
    return _GROUP_NAMES.get(id(group), "other")


def size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False) -> Optional[dist.Work]:
    """In-place all-reduce of `t` over `group`, counted."""
    if size(group) == 1:
        return None
    COUNTER.record(group_name(group), "all_reduce", t)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather_last(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim (the rank order of the group)."""
    n = size(group)
    if n == 1:
        return t
    COUNTER.record(group_name(group), "all_gather", t)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def split_last(t: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of the last dim (no communication)."""
    n = size(group)
    if n == 1:
        return t
    return t.chunk(n, dim=-1)[rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        return g, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return all_gather_last(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        return split_last(g, ctx.group), None


class _SplitToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        return all_gather_last(g, ctx.group), None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the input gradient backward (each rank saw a slice)."""
    return x if size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce of the partial sums forward; identity backward."""
    return x if size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice backward."""
    return x if size(group) == 1 else _GatherFromRegion.apply(x, group)


def split_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if size(group) == 1 else _SplitToRegion.apply(x, group)
