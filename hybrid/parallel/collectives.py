"""Counted collectives and the autograd-aware TP region ops, each taking an explicit group.

Every collective in hybrid goes through `all_reduce` / `all_gather_into` / … below, which
record (op, elements, dtype, group name) in a `CommCounter`, so tests and metrics read the
exact bytes moved per group instead of estimating them, and run under the `CommTimer` (`TIMER`,
`hybrid.parallel.timing`), which on the steps it is switched on for times them. A `None` group or a group of size
one means "no communication": the op is the identity and nothing is recorded.

Bytes are the size of the *whole* tensor a collective works on (elements × dtype size): the
reduced tensor of an all-reduce, the gathered output of an all-gather, the input of a
reduce-scatter. `wire_bytes` turns those into what one rank sends with ring algorithms:
2(n−1)/n of the payload for an all-reduce and (n−1)/n for an all-gather or reduce-scatter, so
one all-reduce moves as much as one all-gather plus one reduce-scatter.

Region ops (Megatron's f/g conjugate pairs):
  copy_to_region            forward identity,              backward all-reduce   (entering column-parallel)
  reduce_from_region        forward all-reduce,            backward identity     (leaving row-parallel)
  gather_from_region        forward all-gather (last dim), backward split        (gathering logits/outputs)
  split_to_region           forward split (last dim),      backward all-gather
Sequence-parallel pair (activations [b, s, h] split along s outside the TP regions):
  gather_from_sequence       forward all-gather (seq),     backward reduce-scatter (entering a TP region)
  reduce_scatter_to_sequence forward reduce-scatter (seq), backward all-gather     (leaving row-parallel)
(The column-parallel layer fuses the first with its matmul to keep only the input chunk:
`hybrid.parallel.tp.overlap.sequence_linear`; `parallel.tp_overlap` launches the backward's exchanges early or
pipelines them around the TP ring there.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel.timing import CommTimer

# the flat collectives under their torch >= 2.13 names (the older names warn there; older torch has only those)
dist_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ShapeGroup:
    """A group that is only its size and this rank's place in it: enough to build a rank's tensors without
    processes (on the meta device, for the memory estimate). No collective runs on it."""

    size: int
    rank: int


Group = Optional[dist.ProcessGroup | ShapeGroup]


@dataclass
class CommCounter:
    """Bytes and calls per (group name, op), accumulated until `reset()`.

    Bytes are the payload handed to the collective: elements × dtype size.
    """

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    sizes: dict[str, int] = field(default_factory=dict)  # group name → ranks in it
    cross: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # group name → bytes off the node

    def record(self, name: str, op: str, tensor: torch.Tensor, group_size: int = 0, cross: float = 0.0) -> None:
        """One call of `op` on `tensor` over group `name` of `group_size` ranks, `cross` of whose payload belongs
        to ranks on other nodes."""
        self.bytes[(name, op)] += tensor.numel() * tensor.element_size()
        self.calls[(name, op)] += 1
        self.cross[name] += tensor.numel() * tensor.element_size() * cross
        if group_size:
            self.sizes[name] = group_size

    def group_bytes(self, name: str) -> int:
        return sum(b for (g, _), b in self.bytes.items() if g == name)

    def cross_node_bytes(self, name: str) -> float:
        """The part of group `name`'s payload that belongs to ranks on other nodes — what leaves (or enters) a
        rank's node whatever the algorithm: (n − l)/n of it for a group of n ranks, l of them on each node."""
        return self.cross.get(name, 0.0)

    def wire_bytes(self, name: str) -> float:
        """Bytes one rank of group `name` sent, for ring all-reduce / all-gather / reduce-scatter."""
        n = self.sizes.get(name, 1)
        return sum(b * bus_factor(op, n) for (g, op), b in self.bytes.items() if g == name)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.cross.clear()


P2P_OPS = ("send_fwd", "send_bwd", "send", "recv", "send_recv", "broadcast", "ring")
"""Ops whose bus bandwidth is their algorithm bandwidth (nccl-tests' factor 1)."""


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw · factor, so busbw is comparable with the link's
    peak whatever the group size. All-reduce 2(n−1)/n; all-gather, reduce-scatter, all-to-all (n−1)/n;
    broadcast and point-to-point 1. It is also the share of the payload one rank puts on the wire."""
    if op in P2P_OPS:
        return 1.0
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


COUNTER = CommCounter()
"""The process-wide tally. Not configuration: a meter read by metrics and tests."""

TIMER = CommTimer()
"""The process-wide clock on the collectives, switched on for the steps that get logged (a meter too)."""

_GROUP_NAMES: dict[int, str] = {}
_CROSS: dict[int, float] = {}  # id(group) → the share of its payload that belongs to ranks on other nodes


def name_group(group: Group, name: str, per_node: int = 0) -> None:
    """Attach a name (tp, dp, pp, dp_intra, …) under which the group's traffic is counted, and how many of its
    ranks share a node (`per_node`; 0: unknown, read as all: nothing of it crosses nodes)."""
    if group is not None:
        _GROUP_NAMES[id(group)] = name
        n = size(group)
        _CROSS[id(group)] = (n - per_node) / n if per_node else 0.0


def count(group: Group, op: str, t: torch.Tensor) -> None:
    """Record `op` on `t` over `group` in the counter, under its name, with its size and its off-node share."""
    COUNTER.record(group_name(group), op, t, size(group), _CROSS.get(id(group), 0.0))


def group_name(group: Group) -> str:
    return _GROUP_NAMES.get(id(group), "other")


def size(group: Group) -> int:
    if isinstance(group, ShapeGroup):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Group) -> int:
    if isinstance(group, ShapeGroup):
        return group.rank
    return 0 if group is None else dist.get_rank(group)


def timed(group: Group, op: str, call: Callable[[], Optional[dist.Work]], async_op: bool) -> Optional[dist.Work]:
    """Run one collective under `TIMER`: a blocking one as a blocking span, an async one from launch
    to the completion of the work it returns."""
    name = group_name(group)
    if not async_op:
        with TIMER.collective(name, op):
            return call()
    start = TIMER.mark()
    with TIMER.label(name, op):
        work = call()
    TIMER.launched(name, op, work, start)
    return work


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False) -> Optional[dist.Work]:
    """In-place all-reduce of `t` over `group`, counted and timed."""
    if size(group) == 1:
        return None
    count(group, "all_reduce", t)
    return timed(group, "all_reduce", lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Group) -> None:
    """Post every send and receive (peers by their rank in `group`) as one `batch_isend_irecv`, then wait for
    all of them. Counted as `send` (what this rank sends) and timed as one span."""
    if not sends and not recvs:
        return
    for t, _ in sends:
        count(group, "send", t)
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    with TIMER.collective(group_name(group), "send_recv"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def all_gather_last(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim (the rank order of the group)."""
    n = size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    timed(group, "all_gather", lambda: dist.all_gather(parts, t.contiguous(), group=group), False)
    out = torch.cat(parts, dim=-1)
    count(group, "all_gather", out)
    return out


def split_last(t: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of the last dim (no communication)."""
    n = size(group)
    if n == 1:
        return t
    return t.chunk(n, dim=-1)[rank(group)].contiguous()


def all_gather_seq(t: torch.Tensor, group: Group, op: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's [b, s/n, …] chunk into a contiguous [b, s, …] (group rank order).

    `op` labels the count: "regather" marks the backward re-gather of a sequence-parallel
    linear layer's input (see `hybrid.parallel.tp.tensor.column_linear`).
    """
    n = size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(n)]
    timed(group, op, lambda: dist.all_gather(parts, t.contiguous(), group=group), False)
    out = torch.cat(parts, dim=1)
    count(group, op, out)
    return out


def reduce_scatter_seq(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum [b, s, …] over the group and keep this rank's [b, s/n, …] chunk of the sum."""
    n = size(group)
    if n == 1:
        return t
    chunks = seq_chunks(t, n)
    out = torch.empty_like(chunks[0])
    count(group, "reduce_scatter", t)
    timed(group, "reduce_scatter", lambda: dist.reduce_scatter(out, chunks, group=group), False)
    return out


def seq_chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """[b, s, …] as n contiguous [b, s/n, …] chunks, a reduce-scatter's inputs (ValueError where s does not divide)."""
    if t.shape[1] % n:
        raise ValueError(f"sequence length {t.shape[1]} does not divide by the TP size {n}")
    return [c.contiguous() for c in t.chunk(n, dim=1)]


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """Rank i's chunk j of `inp` (dim 0 split in equal parts) lands in rank j's chunk i of `out`.

    Counted as the input's bytes (each rank sends all but its own chunk: (n−1)/n on the wire)."""
    if size(group) == 1:
        out.copy_(inp)
        return
    count(group, "all_to_all", inp)
    timed(group, "all_to_all", lambda: dist.all_to_all_single(out.view(-1), inp.reshape(-1), group=group), False)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Group,
                    async_op: bool = False) -> Optional[dist.Work]:
    """Every rank's `inp` stacked along dim 0 of `out` (group rank order). Counted as the output."""
    if size(group) == 1:
        out.copy_(inp.view_as(out))
        return None
    count(group, "all_gather", out)
    return timed(group, "all_gather", lambda: dist_all_gather_single(
        out.view(-1), inp.reshape(-1), group=group, async_op=async_op), async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Group,
                        async_op: bool = False) -> Optional[dist.Work]:
    """Sum `inp` over the group and keep this rank's chunk of dim 0 in `out`. Counted as the input."""
    if size(group) == 1:
        out.copy_(inp.view_as(out))
        return None
    count(group, "reduce_scatter", inp)
    return timed(group, "reduce_scatter", lambda: dist_reduce_scatter_single(
        out.view(-1), inp.reshape(-1), group=group, async_op=async_op), async_op)


def split_seq(t: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of dim 1 (the sequence), no communication."""
    n = size(group)
    if n == 1:
        return t
    if t.shape[1] % n:
        raise ValueError(f"sequence length {t.shape[1]} does not divide by the TP size {n}")
    return t.chunk(n, dim=1)[rank(group)]


def _identity(t: torch.Tensor, group: Group) -> torch.Tensor:
    return t


def _summed(t: torch.Tensor, group: Group) -> torch.Tensor:
    """A fresh tensor holding the all-reduced sum of `t` (`t` itself is left untouched)."""
    t = t.contiguous().clone()
    all_reduce(t, group)
    return t


class _Region(torch.autograd.Function):
    """One conjugate pair of the TP regions: `fwd(x, group)` forward, `bwd(grad, group)` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, fwd: Callable, bwd: Callable) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        return ctx.bwd(g, ctx.group), None, None, None


def conjugate(x: torch.Tensor, group: Group, fwd: Callable, bwd: Callable) -> torch.Tensor:
    """`fwd(x, group)` forward, `bwd(grad, group)` backward: a pair of exchanges each the other's gradient (the
    TP regions below; context parallelism's all-to-alls)."""
    return _Region.apply(x, group, fwd, bwd)


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the input gradient backward (each rank saw a slice)."""
    return x if size(group) == 1 else _Region.apply(x, group, _identity, _summed)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce of the partial sums forward; identity backward."""
    return x if size(group) == 1 else _Region.apply(x, group, _summed, _identity)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice backward."""
    return x if size(group) == 1 else _Region.apply(x, group, all_gather_last, split_last)


def split_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if size(group) == 1 else _Region.apply(x, group, split_last, all_gather_last)


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the sequence chunks forward; reduce-scatter the gradient backward (each rank's
    full-sequence gradient is a partial sum over its TP slice of the next layer)."""
    return x if size(group) == 1 else _Region.apply(x, group, all_gather_seq, reduce_scatter_seq)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatter partial sums into sequence chunks forward; all-gather the gradient backward."""
    return x if size(group) == 1 else _Region.apply(x, group, reduce_scatter_seq, all_gather_seq)
