"""The mesh as pure functions: named axes, their sizes and order, rank ↔ coordinate, every group's ranks.

A layout has one size per axis of `AXES` (tensor, context, data, pipeline parallel) and an order, innermost
first, as Megatron-Core's `RankGenerator(order="tp-cp-ep-dp-pp")`:

    order "tp-cp-dp-pp":  rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

so by default a TP group is consecutive ranks inside one node, CP groups come next, DP replicas follow and
pipeline stages span nodes. `groups("dp")` lists the ranks that differ only in their DP index, one list per
group; `groups("cp-dp")` those that differ in either (CP and DP together). A group's name is its axes in the
layout's order joined by "-", the name the collectives count and time its traffic under. An axis of size 1
changes no rank, group or name: at cp=1 everything is as in the three-axis (pp, dp, tp) mesh.

No process group is needed: unit tests check all of it, and `ParallelContext.build` turns the rank lists into
groups.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

AXES = ("tp", "cp", "dp", "pp")
"""The mesh's axes (Megatron's names; torchtitan's `MeshAxisName`s)."""
DEFAULT_ORDER = "tp-cp-dp-pp"
"""Innermost first: TP on the fastest links, PP across nodes."""
KEY_AXES = ("pp", "dp", "cp", "tp")
"""The order a coordinate is spelled in keys (`Coord.key`), whatever the rank order."""

GROUP_KINDS = ("tp", "dp", "pp", "dp_intra", "dp_inter", "embedding")
"""Every kind of group a rank belongs to, by the name its traffic is counted under."""


IN_NODE_REASON = {"tp": "TP's every-layer all-reduce", "cp": "CP's every-layer K/V exchange"}
"""The axes kept inside a node unless `parallel.allow_<axis>_across_nodes`, and why."""


class LayoutError(ValueError):
    """The (world, sizes, order, node size) combination cannot be laid out."""


@dataclass(frozen=True)
class Coord(Mapping[str, int]):
    """A rank's index along each axis; also a mapping `{axis: index}`."""

    pp: int = 0
    dp: int = 0
    tp: int = 0
    cp: int = 0

    def __getitem__(self, axis: str) -> int:
        if axis not in AXES:
            raise KeyError(axis)
        return getattr(self, axis)

    def __iter__(self) -> Iterator[str]:
        return iter(AXES)

    def __len__(self) -> int:
        return len(AXES)

    def key(self, kind: str) -> str:
        """`kind.pp<p>.dp<d>.tp<t>` (with `.cp<c>` before `.tp` when c > 0): one rank's blob or record key."""
        parts = [f"{a}{self[a]}" for a in KEY_AXES if a != "cp" or self.cp]
        return ".".join([kind, *parts])


@functools.lru_cache(maxsize=64)
def split_order(order: str) -> tuple[str, ...]:
    """"tp-cp-dp-pp" → its axes; LayoutError unless it names each of `AXES` once (each order split once)."""
    axes = tuple(order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise LayoutError(f"parallel order {order!r} must name each of {', '.join(AXES)} once, joined by '-'")
    return axes


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh and of the nodes, and the rank order; every method is a pure function of them."""

    world: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ranks_per_node: int = 1
    cp: int = 1
    order: str = DEFAULT_ORDER

    @staticmethod
    def create(world: int, tp: int = 1, pp: int = 1, dp: Optional[int] = None,
               ranks_per_node: Optional[int] = None, allow_tp_across_nodes: bool = False, cp: int = 1,
               order: str = DEFAULT_ORDER, allow_cp_across_nodes: bool = False) -> Layout:
        """Infer dp, check the sizes and the order, refuse TP or CP across nodes; raises LayoutError."""
        split_order(order)
        for name, v in (("world size", world), ("parallel.tp", tp), ("parallel.cp", cp), ("parallel.pp", pp)):
            if v < 1:
                raise LayoutError(f"{name} must be >= 1, got {v}")
        inferred = infer_dp(world, tp, cp, pp, dp)
        rpn = ranks_per_node or world
        if rpn < 1 or world % rpn:
            raise LayoutError(f"parallel.ranks_per_node={rpn} does not divide world size {world}")
        layout = Layout(world=world, tp=tp, pp=pp, dp=inferred, ranks_per_node=rpn, cp=cp, order=order)
        layout.check_in_nodes("tp", allow_tp_across_nodes)
        layout.check_in_nodes("cp", allow_cp_across_nodes)
        return layout

    def check_in_nodes(self, axis: str, allow: bool) -> None:
        """TP's collectives and CP's K/V exchange run in every layer and need the fast intra-node links: a TP
        or CP group across nodes is refused (or, with `allow`, a warning)."""
        if all(len({self.node(r) for r in g}) == 1 for g in self.groups(axis)):
            return
        msg = (f"{axis.upper()} group of {self.size(axis)} ranks would span nodes of {self.ranks_per_node} ranks; "
               f"{IN_NODE_REASON[axis]} needs the fast intra-node links")
        if not allow:
            raise LayoutError(msg + f" (set parallel.allow_{axis}_across_nodes=true to force it)")
        warnings.warn(msg, stacklevel=3)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes innermost first."""
        return split_order(self.order)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def sizes(self) -> dict[str, int]:
        """`{axis: size}`, innermost first."""
        return {a: self.size(a) for a in self.axes}

    def stride(self, axis: str) -> int:
        """How far apart two ranks are whose index differs by one along `axis`."""
        inner = self.axes[: self.axes.index(axis)]
        return math.prod(self.size(a) for a in inner)

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    def coord(self, rank: int) -> Coord:
        """The rank's index along each axis (worked out once per layout and rank: the step asks for it per op)."""
        return _coord(self, rank)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The rank at that coordinate."""
        index = {"pp": pp, "dp": dp, "tp": tp, "cp": cp}
        return sum(index[a] * self.stride(a) for a in AXES)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def group_name(self, axes: str | Sequence[str]) -> str:
        """The name of the groups over `axes`: those axes in the layout's order, joined by "-"."""
        wanted = set(axes.split("-") if isinstance(axes, str) else axes)
        if not wanted or not wanted <= set(AXES):
            raise LayoutError(f"unknown mesh axes {sorted(wanted)}; the axes are {', '.join(AXES)}")
        return "-".join(a for a in self.axes if a in wanted)

    def axis_groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """The ranks that differ only along `axes` ("dp", "cp-dp", ("tp", "cp")): one list per group, each in
        rank order, the groups ordered by their first rank."""
        return [list(g) for g in _axis_groups(self, tuple(self.group_name(axes).split("-")))]

    def tp_groups(self) -> list[list[int]]:
        return self.axis_groups("tp")

    def dp_groups(self) -> list[list[int]]:
        return self.axis_groups("dp")

    def pp_groups(self) -> list[list[int]]:
        return self.axis_groups("pp")

    def cp_groups(self) -> list[list[int]]:
        return self.axis_groups("cp")

    @property
    def dp_per_node(self) -> int:
        """The DP ranks of a DP group on one node (the size of a `dp_intra` group)."""
        return len(self.dp_intra_node_groups()[0])

    def dp_intra_node_groups(self) -> list[list[int]]:
        """Each DP group cut at node boundaries: the ranks that reduce over fast links."""
        return [part for g in self.dp_groups() for part in self._split_by_node(g)]

    def dp_inter_node_groups(self) -> list[list[int]]:
        """For each DP group, one group per local index across its node parts (the slow hop)."""
        return self.node_split(self.dp_groups())[1]

    def node_split(self, groups: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """Each group's two hops: its parts on one node each (intra), and for each local index the ranks at it on
        every node of the group (inter). Parts must be equal: LayoutError otherwise."""
        intra, inter = [], []
        for g in groups:
            parts = self._split_by_node(g)
            width = len(parts[0])
            if any(len(p) != width for p in parts):
                raise LayoutError(f"DP group {g} is spread unevenly over nodes; hierarchical sync needs equal parts")
            intra += parts
            inter += [[p[i] for p in parts] for i in range(width)]
        return intra, inter

    def per_node(self, ranks: list[int]) -> int:
        """How many of `ranks` share a node (the first's): a group's part that its intra-node links carry."""
        return len(self._split_by_node(ranks)[0])

    def zero_shard_size(self, spec: str) -> int:
        """The DP ranks a ZeRO shard group holds under `parallel.zero_group`: `dp` (all of them), `node` (those on
        one node: hybrid sharding, HSDP) or a number dividing dp."""
        if spec in ("dp", "node"):
            return self.dp if spec == "dp" else self.dp_per_node
        if not str(spec).isdigit() or int(spec) < 1 or self.dp % int(spec):
            raise LayoutError(f"parallel.zero_group={spec} must be dp, node or a number of ranks dividing dp={self.dp}")
        return int(spec)

    def zero_groups(self, size: int) -> tuple[list[list[int]], list[list[int]]]:
        """HSDP's groups: each DP group cut into consecutive parts of `size` ranks (the shard groups: parameters,
        gradients and moments sharded inside one) and the ranks at the same place of each part (the replica
        groups: the shards all-reduced across them)."""
        shard, replica = [], []
        for g in self.dp_groups():
            parts = [g[i: i + size] for i in range(0, len(g), size)]
            shard += parts
            replica += [[part[j] for part in parts] for j in range(size)]
        return shard, replica

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they share the tied embedding's gradient."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def groups(self, kind: str) -> list[list[int]]:
        """The rank lists of every group of `kind`: one of GROUP_KINDS, or any axes as `axis_groups` takes."""
        kinds = {"embedding": self.embedding_groups, "dp_intra": self.dp_intra_node_groups,
                 "dp_inter": self.dp_inter_node_groups}
        return kinds[kind]() if kind in kinds else self.axis_groups(kind)

    def group_sizes(self) -> dict[str, int]:
        """Ranks per group of each kind, by the names the collectives count them under (with cp > 1 the gradients'
        group, counted as "dp", is CP × DP)."""
        sizes = {kind: len(self.groups(kind)[0]) for kind in GROUP_KINDS}
        return sizes | {"cp": self.cp, "dp": self.cp * self.dp}

    def _split_by_node(self, ranks: list[int]) -> list[list[int]]:
        parts: dict[int, list[int]] = {}
        for r in ranks:
            parts.setdefault(self.node(r), []).append(r)
        return list(parts.values())

    def describe(self) -> str:
        """"pp2 × dp2 × tp2" (and "× cp2" where cp > 1): the sizes, outermost first."""
        return " × ".join(f"{a}{self.size(a)}" for a in reversed(self.axes) if a != "cp" or self.cp > 1)

    def rank_map(self) -> str:
        """A printable table: one line per node, each rank with its coordinate."""
        lines = [f"layout: world={self.world} = {self.describe()}, {self.num_nodes} node(s) × "
                 f"{self.ranks_per_node} ranks"]
        for n in range(self.num_nodes):
            ranks = range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node)
            lines.append(f"  node {n}: " + " ".join(f"r{r}=({self._cell(r)})" for r in ranks))
        return "\n".join(lines)

    def _cell(self, rank: int) -> str:
        c = self.coord(rank)
        return ",".join(f"{a}{c[a]}" for a in KEY_AXES if a != "cp" or self.cp > 1)


def infer_dp(world: int, tp: int, cp: int, pp: int, dp: Optional[int]) -> int:
    """world / (tp·cp·pp), checked against an explicit `dp`; LayoutError when it does not divide."""
    sizes = {"tp": tp, "cp": cp, "pp": pp} if cp > 1 else {"tp": tp, "pp": pp}
    others = math.prod(sizes.values())
    if world % others:
        names, values = "·".join(f"parallel.{a}" for a in sizes), "·".join(map(str, sizes.values()))
        raise LayoutError(f"{names} = {values} = {others} does not divide world size {world}")
    inferred = world // others
    if dp is not None and dp != inferred:
        raise LayoutError(f"parallel.dp={dp} but world size {world} / ({'·'.join(sizes)} = {others}) = {inferred}")
    return inferred


@functools.lru_cache(maxsize=256)
def _axis_groups(layout: Layout, varying: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.world):
        c = layout.coord(r)
        groups.setdefault(tuple(c[a] for a in AXES if a not in varying), []).append(r)
    return tuple(sorted(tuple(g) for g in groups.values()))


@functools.lru_cache(maxsize=4096)
def _coord(layout: Layout, rank: int) -> Coord:
    return Coord(**{a: (rank // layout.stride(a)) % layout.size(a) for a in AXES})
