"""ParallelContext: one rank's process groups over the mesh's named axes, built once and passed down.

The mesh itself — axes, sizes, rank order, every group's rank list — is the pure `Layout`
(`parallel/layout.py`, re-exported here). `ParallelContext.build` creates the real groups with
`torch.distributed.new_group` (every rank takes part in every `new_group` call, in the same order,
as the API requires), one set per group kind, each named after its kind for the collectives' counter
and timer. An axis of size 1 gets no groups of its own (the context's group for it is None: the
size-1 path of every collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from hybrid.parallel.collectives import ShapeGroup, name_group
from hybrid.parallel.layout import AXES, GROUP_KINDS, Coord, Layout, LayoutError
from hybrid.parallel.timeouts import timeout_of

__all__ = ["AXES", "GROUP_KINDS", "Coord", "Layout", "LayoutError", "ParallelContext", "more_groups", "pp_streams"]

@dataclass
class ParallelContext:
    """The mesh of one rank: its coordinate, and the groups it belongs to.

    Groups are `None` only when torch.distributed is not initialised (a single process);
    every collective in the code base then runs on a size-1 path with no communication.
    """

    layout: Layout
    rank: int
    tp_group: Optional[dist.ProcessGroup] = None
    cp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_intra_group: Optional[dist.ProcessGroup] = None
    dp_inter_group: Optional[dist.ProcessGroup] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    cp_dp_group: Optional[dist.ProcessGroup] = None  # with cp > 1: the ranks that average gradients (`grad_group`)
    timeout_s: Optional[float] = None  # every group's (`parallel.timeout_s`)

    @property
    def grad_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are averaged over: DP, and under context parallelism CP and DP together (each CP
        rank's gradient is of its tokens only; the weights are replicated over both). Counted as "dp"."""
        return self.cp_dp_group if self.layout.cp > 1 else self.dp_group

    @property
    def coord(self) -> Coord:
        return self.layout.coord(self.rank)

    tp_size = property(lambda self: self.layout.tp)
    cp_size = property(lambda self: self.layout.cp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)
    tp_rank = property(lambda self: self.coord.tp)
    cp_rank = property(lambda self: self.coord.cp)
    pp_rank = property(lambda self: self.coord.pp)
    dp_rank = property(lambda self: self.coord.dp)

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1

    @staticmethod
    def single() -> ParallelContext:
        """A one-process context with no groups (tests, tools, single-process runs)."""
        return ParallelContext(layout=Layout(world=1), rank=0)

    @staticmethod
    def shapes(layout: Layout, rank: int) -> ParallelContext:
        """`rank`'s context in `layout` without processes: its TP, CP, DP and PP groups are `ShapeGroup`s (sizes
        and places only), enough to build the rank's model chunks on the meta device."""
        c = layout.coord(rank)
        return ParallelContext(layout=layout, rank=rank, tp_group=ShapeGroup(layout.tp, c.tp),
                               cp_group=ShapeGroup(layout.cp, c.cp), dp_group=ShapeGroup(layout.dp, c.dp),
                               pp_group=ShapeGroup(layout.pp, c.pp),
                               cp_dp_group=ShapeGroup(layout.cp * layout.dp, c.dp * layout.cp + c.cp))

    @staticmethod
    def build(layout: Layout, timeout_s: Optional[float] = None) -> ParallelContext:
        """Create every group, each named after its kind for the collectives' counter and timer, with
        `timeout_s` (`parallel.timeout_s`; None: torch's default). Collective: all ranks must call it with
        the same layout."""
        if not dist.is_initialized():
            if layout.world != 1:
                raise LayoutError(f"layout needs {layout.world} ranks but torch.distributed is not initialised")
            return ParallelContext.single()
        rank = dist.get_rank()
        if dist.get_world_size() != layout.world:
            raise LayoutError(f"layout is for {layout.world} ranks, world size is {dist.get_world_size()}")
        ctx = ParallelContext(layout=layout, rank=rank, timeout_s=timeout_s)
        for kind in GROUP_KINDS:
            setattr(ctx, f"{kind}_group", groups_of(ctx, layout.groups(kind), kind))
        if layout.cp > 1:
            ctx.cp_group = groups_of(ctx, layout.groups("cp"), "cp")
            ctx.cp_dp_group = groups_of(ctx, layout.groups("cp-dp"), "dp", "cp-dp")  # the record's bytes_dp
        return ctx


def more_groups(ctx: ParallelContext, kind: str, name: str, backend: Optional[str] = None
                ) -> Optional[dist.ProcessGroup]:
    """One more set of groups of `kind` (a group kind or mesh axes, e.g. "dp": the same ranks, separate traffic;
    `backend`: e.g. "gloo" beside NCCL), this rank's, counted as `name`; None in one process. Collective: every
    rank must call it."""
    return groups_of(ctx, ctx.layout.groups(kind), name, kind, backend)


def pp_streams(ctx: ParallelContext, streams: Sequence[str]) -> dict[str, dist.ProcessGroup]:
    """One more group over this rank's pipeline ranks per pipeline comm stream (`pipeline.P2P`), each counted
    as "pp"; {} without a pipeline. Collective: every rank must call it with the same streams."""
    if ctx.layout.pp == 1 or not dist.is_initialized():
        return {}
    out = {}
    for stream in streams:
        out[stream] = _mine(ctx.layout.pp_groups(), ctx.rank, "pp", ctx.timeout_s)
        name_group(out[stream], "pp")
    return out


def groups_of(ctx: ParallelContext, lists: list[list[int]], name: str, desc: Optional[str] = None,
              backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """This rank's group of `lists` (every rank takes part in creating each; torch's description `desc`, default
    `name`), counted as `name` with its ranks per node; None in one process. Collective."""
    if not dist.is_initialized():
        return None
    group = _mine(lists, ctx.rank, desc or name, ctx.timeout_s, backend)
    name_group(group, name, ctx.layout.per_node(lists[0]))
    return group


def _mine(groups: list[list[int]], rank: int, kind: str, timeout_s: Optional[float],
          backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """Create all `groups` (every rank must take part in every new_group) and return ours."""
    found = None
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timeout_of(timeout_s), group_desc=kind, backend=backend)
        if rank in ranks:
            found = g
    return found
