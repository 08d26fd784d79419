"""Warnings about a layout on the measured links, and the layout the links suggest: pure functions of
the bandwidth matrix (GB/s, NaN diagonal), the `Layout` and a few facts, so they are unit-tested on
crafted matrices without a process group.

A warning is a `Finding`: a code, one line of text, the ranks it is about. The thresholds are the
fields of `Thresholds` (docs/diagnose.md states each rule):

- `tp_across_nodes`: a TP group spans nodes (only with `parallel.allow_tp_across_nodes=true`).
- `cp_across_nodes`: a CP group spans nodes (only with `parallel.allow_cp_across_nodes=true`).
- `tp_slow_link`: a TP group holds a link below `tp_link` × the fastest measured link.
- `slow_inter_node`: DP groups span nodes, the inter-node median is below `inter_node` × the intra-node
  median, and `compression.method=none`: compression would cut the slow hop's bytes (under ZeRO sharded
  across the nodes: hybrid sharding or ZeRO++).
- `slow_rank`: every link of a rank is more than `slow_rank` below the median of its class.
- `node_spans_hosts`: one of the trainer's nodes holds ranks of several hosts.
- `versions_differ`: ranks run different torch / python / CUDA / NCCL / driver versions.

The suggestion takes the largest tp whose TP groups (consecutive ranks, as hybrid places them) use only
fast links (≥ `tp_link` × the fastest) and stay inside a node.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from hybrid.parallel.context import Layout

from .pairwise import Matrix, links, split_links

ACROSS = {"tp": "TP all-reduce", "cp": "CP K/V exchange"}  # what a group across nodes sends on the slow link
VERSION_KEYS = ("torch", "python", "cuda", "nccl", "driver")


@dataclass(frozen=True)
class Thresholds:
    tp_link: float = 0.5  # a link below this share of the fastest measured link is slow for TP
    inter_node: float = 0.25  # inter-node median below this share of the intra-node median is a slow hop
    slow_rank: float = 0.5  # a rank is slow when all its links are more than this share below their class median


@dataclass(frozen=True)
class Finding:
    """One warning: a stable code, one line of text, the ranks concerned."""

    code: str
    message: str
    ranks: tuple[int, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "ranks": list(self.ranks)}


def node_of(layout: Layout) -> list[int]:
    """The node of every rank, as the trainer assigns them (rank // ranks_per_node)."""
    return [layout.node(r) for r in range(layout.world)]


def best_link(matrix: Matrix) -> float:
    """The fastest measured link (0 without links)."""
    return max((bw for _, _, bw in links(matrix)), default=0.0)


def worst_link(matrix: Matrix, group: Sequence[int]) -> float:
    """The slowest link between two ranks of `group` (inf for a group of one)."""
    return min((matrix[a][b] for i, a in enumerate(group) for b in group[i + 1:]), default=math.inf)


def spans_nodes(layout: Layout, group: Sequence[int]) -> bool:
    return len({layout.node(r) for r in group}) > 1


def _medians(matrix: Matrix, layout: Layout) -> dict[str, float]:
    """The median link of each class that has links ("intra", "inter")."""
    return {k: statistics.median(v) for k, v in split_links(matrix, node_of(layout)).items() if v}


def _ranks_of(groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sorted({r for g in groups for r in g}))


def across_nodes_findings(layout: Layout, matrix: Matrix, axis: str) -> list[Finding]:
    """`<axis>_across_nodes`: groups of `axis` (tp, cp) that span nodes, with the links' medians."""
    groups = [g for g in layout.groups(axis) if len(g) > 1]
    crossing = [g for g in groups if spans_nodes(layout, g)]
    if not crossing:
        return []
    med = _medians(matrix, layout)
    links_note = (f" (inter-node median {med['inter']:.3g} GB/s vs intra-node {med['intra']:.3g} GB/s)"
                  if {"intra", "inter"} <= med.keys() else "")
    name = axis.upper()
    return [Finding(f"{axis}_across_nodes", f"{len(crossing)} of {len(groups)} {name} groups span nodes (first: "
                    f"ranks {crossing[0]} on nodes {sorted({layout.node(r) for r in crossing[0]})}): every "
                    f"{ACROSS[axis]} crosses the inter-node link{links_note}", _ranks_of(crossing))]


def tp_findings(layout: Layout, matrix: Matrix, th: Thresholds = Thresholds()) -> list[Finding]:
    """TP groups that span nodes, and TP groups holding a link much slower than the fastest."""
    groups, out = [g for g in layout.tp_groups() if len(g) > 1], across_nodes_findings(layout, matrix, "tp")
    best = best_link(matrix)
    slow = sorted((worst_link(matrix, g), g) for g in groups if worst_link(matrix, g) < th.tp_link * best)
    if slow:
        out.append(Finding("tp_slow_link", f"{len(slow)} of {len(groups)} TP groups hold a link below "
                           f"{th.tp_link:.0%} of the fastest ({best:.3g} GB/s): slowest ranks {slow[0][1]} at "
                           f"{slow[0][0]:.3g} GB/s", _ranks_of([g for _, g in slow])))
    return out


def inter_node_findings(layout: Layout, matrix: Matrix, method: str, th: Thresholds = Thresholds(), zero: int = 0,
                        zero_group: str = "dp") -> list[Finding]:
    """A slow inter-node hop under DP groups that cross it, with the exact (uncompressed) gradient sync — under ZeRO
    (`zero` ≥ 1) sharded across the nodes (`zero_group=dp`; HSDP keeps its shards inside a node)."""
    crossing = [g for g in layout.dp_groups() if spans_nodes(layout, g)]
    med = _medians(matrix, layout)
    if method != "none" or not crossing or not {"intra", "inter"} <= med.keys() or (zero and zero_group != "dp"):
        return []
    if med["inter"] >= th.inter_node * med["intra"]:
        return []
    share = med["inter"] / med["intra"]
    return [Finding("slow_inter_node", f"inter-node median {med['inter']:.3g} GB/s is {share:.0%} of the intra-node "
                    f"{med['intra']:.3g} GB/s and {len(crossing)} DP group(s) span nodes with "
                    f"compression.method=none: {_dp_remedy(zero)}", _ranks_of(crossing))]


def _dp_remedy(zero: int) -> str:
    """What cuts the slow hop's DP bytes: a compression method, or under ZeRO hybrid sharding or ZeRO++."""
    if not zero:
        return ("try compression=hierarchical-powersgd (exact inside a node, PowerSGD between nodes) or "
                "compression=powersgd")
    plus = "parallel.zero_hpz=true, parallel.zero_param_codec=int8 and " if zero == 3 else ""
    return (f"ZeRO-{zero} shards across the nodes; try parallel.zero_group=node (HSDP: only one all-reduce of the "
            f"shards a step crosses nodes) or ZeRO++: {plus}compression=int4 (int4 between nodes, exact inside)")


def slow_rank_findings(layout: Layout, matrix: Matrix, th: Thresholds = Thresholds()) -> list[Finding]:
    """Ranks all of whose links are more than `th.slow_rank` below their class's median."""
    med, nodes = _medians(matrix, layout), node_of(layout)
    ratios: dict[int, list[float]] = {r: [] for r in range(layout.world)}
    for i, j, bw in links(matrix):
        ratio = bw / max(med["intra" if nodes[i] == nodes[j] else "inter"], 1e-30)
        ratios[i].append(ratio)
        ratios[j].append(ratio)
    return [Finding("slow_rank", f"rank {r}: all {len(v)} of its links are more than {th.slow_rank:.0%} below their "
                    f"class median (its best is {max(v):.0%} of the median)", (r,))
            for r, v in ratios.items() if v and max(v) < 1 - th.slow_rank]


def node_findings(layout: Layout, hosts: Sequence[str]) -> list[Finding]:
    """The trainer's nodes (rank // ranks_per_node) that hold ranks of more than one host."""
    out = []
    for n in range(layout.num_nodes):
        ranks = range(n * layout.ranks_per_node, (n + 1) * layout.ranks_per_node)
        names = sorted({hosts[r] for r in ranks})
        if len(names) > 1:
            out.append(Finding("node_spans_hosts", f"node {n} (ranks {ranks[0]}-{ranks[-1]}) holds ranks of "
                               f"{len(names)} hosts ({', '.join(names)}): what the trainer keeps inside a node "
                               "crosses the network", tuple(ranks)))
    return out


def version_findings(versions: Sequence[dict[str, object]]) -> list[Finding]:
    """Versions that are not the same on every rank; the ranks named are those off the most common one."""
    out = []
    for key in VERSION_KEYS:
        seen = Counter(str(v.get(key)) for v in versions)
        if len(seen) > 1:
            common = seen.most_common(1)[0][0]
            ranks = tuple(r for r, v in enumerate(versions) if str(v.get(key)) != common)
            out.append(Finding("versions_differ", f"{key} differs between ranks: {', '.join(sorted(seen))} "
                               f"(most ranks: {common})", ranks))
    return out


def findings(layout: Layout, matrix: Matrix, method: str, th: Thresholds = Thresholds(), zero: int = 0,
             zero_group: str = "dp") -> list[Finding]:
    """Every warning about the links under `layout` with compression `method` and ZeRO stage `zero` over
    `zero_group`."""
    return (tp_findings(layout, matrix, th) + across_nodes_findings(layout, matrix, "cp")
            + inter_node_findings(layout, matrix, method, th, zero, zero_group)
            + slow_rank_findings(layout, matrix, th))


@dataclass(frozen=True)
class TpOption:
    """TP of size `tp` over consecutive ranks: its slowest link, whether its groups stay inside nodes."""

    tp: int
    worst_gbs: float
    within_nodes: bool
    fast: bool  # every TP link >= the fast threshold


@dataclass
class Suggestion:
    tp: int  # the largest tp on fast links inside nodes (1 when there is none)
    ranks_per_node: int  # the node size that tp respects (the layout's)
    links_tp: int  # the largest tp on fast links, node boundaries ignored (> tp: the links show no boundary)
    fast_gbs: float  # the threshold: tp_link × the fastest link
    islands: list[list[int]]  # connected components of the fast links
    consecutive: bool  # every island is a run of consecutive ranks
    options: list[TpOption] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {**{k: v for k, v in asdict(self).items() if k != "options"},
                "options": [asdict(o) for o in self.options]}


def islands(matrix: Matrix, threshold: float) -> list[list[int]]:
    """The groups of ranks joined by links >= `threshold` (connected components), by lowest rank."""
    parent = list(range(len(matrix)))

    def root(r: int) -> int:
        while parent[r] != r:
            r = parent[r]
        return r

    for i, j, bw in links(matrix):
        if bw >= threshold:
            parent[root(j)] = root(i)
    groups: dict[int, list[int]] = {}
    for r in range(len(matrix)):
        groups.setdefault(root(r), []).append(r)
    return sorted(groups.values())


def suggest(layout: Layout, matrix: Matrix, th: Thresholds = Thresholds()) -> Suggestion:
    """The largest tp whose consecutive-rank TP groups use only fast links and stay inside a node."""
    fast = th.tp_link * best_link(matrix)
    found = islands(matrix, fast)
    options = []
    for tp in (t for t in range(2, layout.world + 1) if layout.world % t == 0):
        groups = [list(range(s, s + tp)) for s in range(0, layout.world, tp)]
        worst = min(worst_link(matrix, g) for g in groups)
        options.append(TpOption(tp, worst, not any(spans_nodes(layout, g) for g in groups), worst >= fast))
    return Suggestion(tp=max((o.tp for o in options if o.fast and o.within_nodes), default=1),
                      ranks_per_node=layout.ranks_per_node, links_tp=max((o.tp for o in options if o.fast), default=1),
                      fast_gbs=fast, islands=found, consecutive=all(g == list(range(g[0], g[-1] + 1)) for g in found),
                      options=options)
