"""The cluster report: every rank's facts, the node assignment, the bandwidth matrix, the layout, the
warnings and the suggestion, as one `Report` that renders as text (`render`) and as JSON (`to_json`,
schema in docs/diagnose.md). Pure: it holds what the tool gathered and measured, it runs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from hybrid.parallel.context import Layout
from hybrid.record.comm_env import spans

from .advice import Finding, Suggestion, Thresholds, node_of, worst_link
from .nccl_advice import Advice
from .nccl_advice import render as nccl_section
from .pairwise import Matrix, rounds, summarize
from .topology import by_class, gpu_lines, pair_classes, parse

Facts = dict[str, Any]  # JSON-like facts of a rank (hybrid.diagnostics.system)
MATRIX_MAX = 16  # the text shows the whole matrix up to this many ranks, else a line per rank
SCHEMA = 1


@dataclass(frozen=True)
class Probe:
    """How the matrix was measured."""

    size: int  # bytes per transfer
    iters: int
    warmup: int
    serial: bool  # one pair at a time instead of a tournament round of pairs


@dataclass
class Report:
    facts: list[Facts]  # by rank
    layout: Layout  # its ranks_per_node is the node assignment
    node_source: str  # where the node size comes from ("hosts", "parallel.ranks_per_node=2", …)
    matrix: Matrix  # GB/s, NaN diagonal
    probe: Probe
    compression: str  # what cuts the DP bytes (`hybrid.sync.bytes_cut_by`): a compression method, sync=<mode>, or none
    warnings: list[Finding]
    suggestion: Optional[Suggestion]  # None for a world of one
    thresholds: Thresholds = Thresholds()
    nccl: Optional[list[Advice]] = None  # `--nccl`: the settings advised (hybrid.diagnostics.nccl_advice)

    @cached_property
    def classes(self) -> dict[tuple[int, int], str]:
        """The link class of every pair of ranks (`topology.pair_classes`), worked out once."""
        return pair_classes(self.facts)

    def to_json(self) -> dict[str, object]:
        lay = self.layout
        return {
            "schema": SCHEMA, "world": lay.world, "backend": self.facts[0]["versions"]["backend"],
            "device": self.facts[0]["device"]["kind"],
            "nodes": {"count": lay.num_nodes, "ranks_per_node": lay.ranks_per_node, "source": self.node_source,
                      "node_of": node_of(lay), "hosts": [f["hostname"] for f in self.facts]},
            "ranks": [{k: v for k, v in f.items() if k != "host"} for f in self.facts],
            "hosts": {f["host"]["hostname"]: f["host"] for f in reversed(self.facts) if "host" in f},
            "bandwidth": {"unit": "GB/s", "method": "ping-pong, median iteration", "size_bytes": self.probe.size,
                          "iters": self.probe.iters, "warmup": self.probe.warmup, "serial": self.probe.serial,
                          "rounds": len(rounds(lay.world, self.probe.serial)),
                          "matrix": [[None if math.isnan(v) else v for v in row] for row in self.matrix],
                          "summary": summarize(self.matrix, node_of(lay)),
                          "classes": {f"{i}-{j}": c for (i, j), c in self.classes.items()},
                          "by_class": by_class(self.matrix, self.classes)},
            "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ranks_per_node": lay.ranks_per_node,
                       "compression": self.compression, "tp_groups": lay.tp_groups(), "dp_groups": lay.dp_groups(),
                       "pp_groups": lay.pp_groups()},
            "warnings": [w.to_json() for w in self.warnings],
            "suggestion": self.suggestion.to_json() if self.suggestion else None,
            "nccl": None if self.nccl is None else [a.to_json() for a in self.nccl],
        }


def gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def size_text(n: int) -> str:
    """Bytes as the largest binary unit that divides them (4 MiB, 64 KiB, 1000 B)."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def render(rep: Report) -> str:
    """The readable report, one section after the other."""
    parts = [header(rep), ranks_section(rep), hosts_section(rep), bandwidth_section(rep), layout_section(rep),
             warnings_section(rep), suggestion_section(rep), nccl_section(rep.nccl) if rep.nccl is not None else ""]
    return "\n\n".join(p for p in parts if p)


def header(rep: Report) -> str:
    lay, f0 = rep.layout, rep.facts[0]
    hosts = sorted({f["hostname"] for f in rep.facts})
    return (f"hybrid-diagnose: world {lay.world}, backend {f0['versions']['backend']} on {f0['device']['kind']}, "
            f"{lay.num_nodes} node(s) × {lay.ranks_per_node} ranks (node size from {rep.node_source}), "
            f"{len(hosts)} host(s): {', '.join(hosts)}")


def device_text(d: Facts) -> str:
    if d["kind"] == "cuda":
        bus = f", bus {d['bus_id']}" if d.get("bus_id") else ""
        return f"cuda:{d['index']} {d['name']} (sm {d['capability']}{bus}), {gib(d['memory_bytes'])}"
    return f"cpu: {d['name']} ({d['cores']} cores, {d['threads']} torch threads), {gib(d['memory_bytes'])}"


def ranks_section(rep: Report) -> str:
    rows = [f"  {'rank':>4} {'node':>4} {'local':>5}  {'host':<16} device"]
    for f in rep.facts:
        local = "-" if f["local_rank"] is None else f["local_rank"]
        rows.append(f"  {f['rank']:>4} {rep.layout.node(f['rank']):>4} {local:>5}  {f['hostname']:<16} "
                    f"{device_text(f['device'])}")
    return "\n".join(["ranks", *rows, common_lines("versions", [f["versions"] for f in rep.facts]),
                      common_lines("environment", [f["env"] for f in rep.facts])])


def common_lines(title: str, per_rank: list[dict[str, Any]]) -> str:
    """`title` (every rank): the entries all ranks share; then, per rank, the entries that differ."""
    shared = {k: v for k, v in per_rank[0].items() if all(d.get(k, object()) == v for d in per_rank)}
    lines = [f"{title} (every rank): " + (" ".join(f"{k}={v}" for k, v in shared.items()) or "none")]
    for r, d in enumerate(per_rank):
        rest = {k: v for k, v in d.items() if k not in shared}
        if rest:
            lines.append(f"  rank {r}: " + " ".join(f"{k}={v}" for k, v in rest.items()))
    return "\n".join(lines)


def hosts_section(rep: Report) -> str:
    """Per host: CPU, memory, NUMA nodes, NICs, `nvidia-smi topo -m` (from the first rank that read them)."""
    out = []
    for host, facts in {f["host"]["hostname"]: f["host"] for f in reversed(rep.facts) if "host" in f}.items():
        ranks = [f["rank"] for f in rep.facts if f["hostname"] == host]
        numa = ", ".join(f"node{n['node']} cpus {n['cpus']}" for n in facts["numa"]) or "not available"
        nics = ", ".join(f"{n['name']} ({n['state']}, {_or_q(n['speed_mbps'], ' Mb/s')}, numa "
                         f"{_or_q(n['numa_node'])})" for n in facts["nics"]) or "not available"
        out.append("\n".join([f"host {host} (ranks {spans(ranks)})",
                              f"  cpu: {facts['cpu']}, {facts['cores']} cores, {gib(facts['memory_bytes'])}",
                              f"  numa: {numa}", f"  nics: {nics}", topology_lines(facts.get("topology"))]))
    return "\n".join(sorted(out))


def topology_lines(text: Optional[str]) -> str:
    """`nvidia-smi topo -m` classified: per GPU its NUMA node, CPUs and nearest NIC, the GPU pairs by class (the
    raw text is in the JSON)."""
    topo = parse(text)
    if topo is None:
        return "  gpu topology (nvidia-smi topo -m): " + ("not a GPU matrix" if text else "not available")
    return "  gpu topology (nvidia-smi topo -m):" + "".join(f"\n    {line}" for line in gpu_lines(topo))


def _or_q(v: Optional[int], unit: str = "") -> str:
    return "?" if v is None else f"{v}{unit}"


def bandwidth_section(rep: Report) -> str:
    p, world = rep.probe, rep.layout.world
    if world == 1:
        return "bandwidth: a world of 1 has no links to measure"
    kind = "one pair at a time" if p.serial else "tournament rounds of concurrent pairs"
    head = (f"bandwidth (GB/s, one way; median of {p.iters} ping-pongs of {size_text(p.size)} after {p.warmup} "
            f"warm-up per pair, {len(rounds(world, p.serial))} rounds, {kind})")
    body = matrix_table(rep.matrix) if world <= MATRIX_MAX else per_rank_lines(rep.matrix)
    summary = summarize(rep.matrix, node_of(rep.layout))
    lines = [f"  {name}-node: " + (f"{s['count']} links, min {s['min']:.3g} median {s['median']:.3g} "
                                   f"max {s['max']:.3g}" if s else "no links") for name, s in summary.items()]
    classes = [f"  {name}: {s['links']} links, min {s['min']:.3g} median {s['median']:.3g} max {s['max']:.3g}"
               for name, s in by_class(rep.matrix, rep.classes).items()]
    return "\n".join([head, body, *lines, "  by link class (docs/diagnose.md):", *classes])


def matrix_table(matrix: Matrix) -> str:
    cells = [[("-" if math.isnan(v) else f"{v:.3g}") for v in row] for row in matrix]
    width = max(5, *(len(c) for row in cells for c in row))
    head = "  " + " " * 4 + "".join(f"{f'r{j}':>{width + 1}}" for j in range(len(matrix)))
    return "\n".join([head] + [f"  {f'r{i}':<4}" + "".join(f"{c:>{width + 1}}" for c in row)
                               for i, row in enumerate(cells)])


def per_rank_lines(matrix: Matrix) -> str:
    """For a large world: each rank's slowest and fastest link (the full matrix is in the JSON)."""
    out = []
    for i, row in enumerate(matrix):
        vals = [v for j, v in enumerate(row) if j != i]
        out.append(f"  r{i}: min {min(vals):.3g} max {max(vals):.3g}")
    return "\n".join(out)


def layout_section(rep: Report) -> str:
    lay = rep.layout
    groups = [g for g in lay.tp_groups() if len(g) > 1]
    tp = "; ".join(f"{g}: {worst_link(rep.matrix, g):.3g}" for g in groups[:8]) + (" …" if len(groups) > 8 else "")
    return "\n".join([lay.rank_map(), f"  compression: {rep.compression}",
                      "  TP groups, slowest link in GB/s: " + (tp or "none (tp=1)")])


def warnings_section(rep: Report) -> str:
    if not rep.warnings:
        return "warnings: none"
    return "\n".join([f"warnings ({len(rep.warnings)})", *(f"  [{w.code}] {w.message}" for w in rep.warnings)])


def suggestion_section(rep: Report) -> str:
    s = rep.suggestion
    if s is None:
        return ""
    lines = [f"suggestion (rule: the largest tp whose TP groups — consecutive ranks — stay inside a node and use only "
             f"links ≥ {rep.thresholds.tp_link:.0%} of the fastest, here ≥ {s.fast_gbs:.3g} GB/s)",
             "  fast islands (ranks joined by such links): " + " | ".join(spans(g) for g in s.islands)]
    lines += [f"  tp={o.tp}: slowest TP link {o.worst_gbs:.3g} GB/s, "
              f"{'inside nodes' if o.within_nodes else 'crosses nodes'}, {'fast' if o.fast else 'SLOW'}"
              for o in s.options]
    lines.append(f"  → parallel.tp={s.tp} with ranks_per_node={s.ranks_per_node}"
                 + (" (no tp > 1 keeps TP on fast links inside a node)" if s.tp == 1 else
                    f": TP groups {spans(list(range(s.tp)))}, … each inside one node, on fast links"))
    if s.links_tp > s.tp:
        lines.append(f"  → the links alone allow tp={s.links_tp} (no slow link between the nodes: emulated nodes?), "
                     f"with parallel.ranks_per_node={s.links_tp}")
    if not s.consecutive:
        lines.append("  → the fast islands are not runs of consecutive ranks: order the ranks (hosts, "
                     "CUDA_VISIBLE_DEVICES) so that each island is consecutive, as hybrid places TP groups")
    return "\n".join(lines)
