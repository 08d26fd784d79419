"""ParallelContext: the 3D (pp, dp, tp) mesh of process groups, built once and passed down.

Rank order is TP innermost (consecutive ranks, inside one node, over the fast links),
then DP, then PP outermost (stages across nodes):

    rank = (pp_rank · dp + dp_rank) · tp + tp_rank

`Layout` is the pure part — sizes, rank → coordinates, the rank lists of every group —
so unit tests can check it without a process group. `ParallelContext.build` creates the
real groups with `torch.distributed.new_group` (every rank takes part in every
`new_group` call, in the same order, as the API requires).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from hybrid.parallel.collectives import ShapeGroup, name_group
from hybrid.parallel.timeouts import timeout_of

GROUP_KINDS = ("tp", "dp", "pp", "dp_intra", "dp_inter", "embedding")
"""Every kind of group a rank belongs to, by the name its traffic is counted under."""


class LayoutError(ValueError):
    """The (world, tp, pp, dp, node size) combination cannot be laid out."""


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh and of the nodes; every method is a pure function of them."""

    world: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ranks_per_node: int = 1

    @staticmethod
    def create(
        world: int,
        tp: int = 1,
        pp: int = 1,
        dp: Optional[int] = None,
        ranks_per_node: Optional[int] = None,
        allow_tp_across_nodes: bool = False,
    ) -> Layout:
        """Infer dp, check the sizes, refuse TP across nodes; raises LayoutError."""
        for name, v in (("world size", world), ("parallel.tp", tp), ("parallel.pp", pp)):
            if v < 1:
                raise LayoutError(f"{name} must be >= 1, got {v}")
        if world % (tp * pp):
            raise LayoutError(f"parallel.tp·parallel.pp = {tp}·{pp} = {tp * pp} does not divide world size {world}")
        inferred = world // (tp * pp)
        if dp is not None and dp != inferred:
            raise LayoutError(f"parallel.dp={dp} but world size {world} / (tp·pp = {tp * pp}) = {inferred}")
        rpn = ranks_per_node or world
        if rpn < 1 or world % rpn:
            raise LayoutError(f"parallel.ranks_per_node={rpn} does not divide world size {world}")
        if tp > rpn or rpn % tp:
            msg = f"TP group of {tp} ranks would span nodes of {rpn} ranks; TP needs the fast intra-node links"
            if not allow_tp_across_nodes:
                raise LayoutError(msg + " (set parallel.allow_tp_across_nodes=true to force it)")
            warnings.warn(msg, stacklevel=2)
        return Layout(world=world, tp=tp, pp=pp, dp=inferred, ranks_per_node=rpn)

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    def coord(self, rank: int) -> Coord:
        return Coord(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def dp_per_node(self) -> int:
        """The DP ranks of a DP group on one node (the size of a `dp_intra` group)."""
        return len(self.dp_intra_node_groups()[0])

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_intra_node_groups(self) -> list[list[int]]:
        """Each DP group cut at node boundaries: the ranks that reduce over fast links."""
        return [part for g in self.dp_groups() for part in self._split_by_node(g)]

    def dp_inter_node_groups(self) -> list[list[int]]:
        """For each DP group, one group per local index across its node parts (the slow hop)."""
        out = []
        for g in self.dp_groups():
            parts = self._split_by_node(g)
            width = len(parts[0])
            if any(len(p) != width for p in parts):
                raise LayoutError(f"DP group {g} is spread unevenly over nodes; hierarchical sync needs equal parts")
            out += [[p[i] for p in parts] for i in range(width)]
        return out

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they share the tied embedding's gradient."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def groups(self, kind: str) -> list[list[int]]:
        """The rank lists of every group of `kind` (one of GROUP_KINDS)."""
        kinds = {"tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups, "embedding": self.embedding_groups,
                 "dp_intra": self.dp_intra_node_groups, "dp_inter": self.dp_inter_node_groups}
        return kinds[kind]()

    def group_sizes(self) -> dict[str, int]:
        """Ranks per group of each kind, by the names the collectives count them under."""
        return {kind: len(self.groups(kind)[0]) for kind in GROUP_KINDS}

    def _split_by_node(self, ranks: list[int]) -> list[list[int]]:
        parts: dict[int, list[int]] = {}
        for r in ranks:
            parts.setdefault(self.node(r), []).append(r)
        return list(parts.values())

    def rank_map(self) -> str:
        """A printable table: one line per node, each rank with its (pp, dp, tp) coordinate."""
        lines = [f"layout: world={self.world} = pp{self.pp} × dp{self.dp} × tp{self.tp}, "
                 f"{self.num_nodes} node(s) × {self.ranks_per_node} ranks"]
        for n in range(self.num_nodes):
            cells = []
            for r in range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node):
                c = self.coord(r)
                cells.append(f"r{r}=(pp{c.pp},dp{c.dp},tp{c.tp})")
            lines.append(f"  node {n}: " + " ".join(cells))
        return "\n".join(lines)


@dataclass
class ParallelContext:
    """The mesh of one rank: its coordinate, and the groups it belongs to.

    Groups are `None` only when torch.distributed is not initialised (a single process);
    every collective in the code base then runs on a size-1 path with no communication.
    """

    layout: Layout
    rank: int
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_intra_group: Optional[dist.ProcessGroup] = None
    dp_inter_group: Optional[dist.ProcessGroup] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    timeout_s: Optional[float] = None  # every group's (`parallel.timeout_s`)

    @property
    def coord(self) -> Coord:
        return self.layout.coord(self.rank)

    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)
    tp_rank = property(lambda self: self.coord.tp)
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
        """`rank`'s context in `layout` without processes: its TP, DP and PP groups are `ShapeGroup`s (sizes
        and places only), enough to build the rank's model chunks on the meta device."""
        c = layout.coord(rank)
        return ParallelContext(layout=layout, rank=rank, tp_group=ShapeGroup(layout.tp, c.tp),
                               dp_group=ShapeGroup(layout.dp, c.dp), pp_group=ShapeGroup(layout.pp, c.pp))

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
        ctx.tp_group = _mine(layout.tp_groups(), rank, "tp", timeout_s)
        ctx.dp_group = _mine(layout.dp_groups(), rank, "dp", timeout_s)
        ctx.pp_group = _mine(layout.pp_groups(), rank, "pp", timeout_s)
        ctx.dp_intra_group = _mine(layout.dp_intra_node_groups(), rank, "dp_intra", timeout_s)
        ctx.dp_inter_group = _mine(layout.dp_inter_node_groups(), rank, "dp_inter", timeout_s)
        ctx.embedding_group = _mine(layout.embedding_groups(), rank, "embedding", timeout_s)
        for kind in GROUP_KINDS:
            name_group(getattr(ctx, f"{kind}_group"), kind)
        return ctx


def more_groups(ctx: ParallelContext, kind: str, name: str, backend: Optional[str] = None
                ) -> Optional[dist.ProcessGroup]:
    """One more set of groups of `kind` (e.g. "dp": the same ranks, separate traffic; `backend`: e.g. "gloo"
    beside NCCL), this rank's, counted as `name`; None in one process. Collective: every rank must call it."""
    if not dist.is_initialized():
        return None
    group = _mine(ctx.layout.groups(kind), ctx.rank, kind, ctx.timeout_s, backend)
    name_group(group, name)
    return group


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


def _mine(groups: list[list[int]], rank: int, kind: str, timeout_s: Optional[float],
          backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """Create all `groups` (every rank must take part in every new_group) and return ours."""
    found = None
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timeout_of(timeout_s), group_desc=kind, backend=backend)
        if rank in ranks:
            found = g
    return found
