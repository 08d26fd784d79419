"""The preflight: a quick sniff test of every rank and ring link before a training run starts (in the
spirit of Megatron's GPU sniff test and torchtitan's preflight checks).

It runs, in this order, over the world:
1. a small and a large all-reduce (`bandwidth.measure`, with its correctness check): latency, bus
   bandwidth, and whether the sums come back right;
2. a ring of point-to-point links, r → r+1 for every r, each timed on its own: links run in two phases
   of disjoint pairs (three when the world is odd), so a link shares its ranks with no other link
   while it is timed; the sender times each message until the receiver's one-element ack is back;
3. a GEMM on every rank at once (an n×n matmul sized for the device: small on a CPU).

Why per rank and per link: inside a collective a slow rank does not stand out, everyone waits for it
and the slow rank itself, arriving last, waits least. Its own compute (the GEMM) and its own links do
show it. A rank's GEMM time or a link's time that exceeds the median over the world by more than the
threshold (percent) is flagged, as is any wrong element of the all-reduces. Times are medians over
the iterations, so a single preempted iteration does not flag a healthy rank.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybrid.diagnostics.bandwidth import GroupSet, Table, gather_world, measure, synchronize, world_barrier

KIB, MIB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Plan:
    """What the preflight measures: all-reduce sizes, bytes per link message, the GEMM, iterations."""

    small: int
    large: int
    link: int
    gemm: int  # n of the n×n GEMM
    dtype: torch.dtype
    iters: int
    warmup: int


def plan_for(device: torch.device) -> Plan:
    """Sizes that take well under a second: a 256² fp32 GEMM and 4 MiB messages on a CPU, an 8192²
    bf16 GEMM (1.1 TFLOP) and 256 MiB messages on a GPU."""
    if device.type == "cuda":
        return Plan(small=4 * KIB, large=256 * MIB, link=256 * MIB, gemm=8192, dtype=torch.bfloat16, iters=10,
                    warmup=2)
    return Plan(small=4 * KIB, large=4 * MIB, link=4 * MIB, gemm=256, dtype=torch.float32, iters=10, warmup=1)


@dataclass
class Report:
    """Everything rank 0 prints; the same on every rank."""

    plan: Plan
    threshold: float
    hosts: list[str]
    gemm: list[float]  # seconds per GEMM, by rank (median over iterations)
    link: list[float]  # seconds per message on link r → r+1, by r (nan in a world of one)
    allreduce: list[Table]
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems


def gemm_seconds(plan: Plan, device: torch.device) -> float:
    """Median seconds of one n×n GEMM on this rank."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(plan.gemm, plan.gemm, generator=gen).to(device, plan.dtype) for _ in range(2))
    times = []
    for _ in range(plan.warmup + plan.iters):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[plan.warmup:])


def link_phase(k: int, n: int) -> int:
    """The phase of link k → k+1: even links first, then odd ones; in an odd world the closing link
    n−1 → 0 shares rank 0 with link 0 → 1 and gets a phase of its own."""
    return 2 if n % 2 and k == n - 1 else k % 2


def _send(buf: torch.Tensor, ack: torch.Tensor, peer: int, plan: Plan, device: torch.device) -> float:
    """Median seconds from sending `buf` to `peer` until its ack has come back."""
    times = []
    for _ in range(plan.warmup + plan.iters):
        start = time.perf_counter()
        dist.send(buf, peer)
        dist.recv(ack, peer)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[plan.warmup:])


def _receive(buf: torch.Tensor, ack: torch.Tensor, peer: int, plan: Plan) -> None:
    for _ in range(plan.warmup + plan.iters):
        dist.recv(buf, peer)
        dist.send(ack, peer)


def link_seconds(plan: Plan, device: torch.device) -> float:
    """Seconds per message on this rank's outgoing link r → r+1 (nan in a world of one). Collective:
    every rank takes part in every phase (a world barrier opens each)."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return math.nan
    buf = torch.ones(plan.link // 4, device=device)
    ack = torch.zeros(1, device=device)
    mine = math.nan
    for phase in range(3 if n % 2 else 2):
        world_barrier(device)
        if link_phase(me, n) == phase:
            mine = _send(buf, ack, (me + 1) % n, plan, device)
        elif link_phase((me - 1) % n, n) == phase:
            _receive(buf, ack, (me - 1) % n, plan)
    world_barrier(device)
    return mine


def over_median(values: Sequence[float], threshold: float) -> list[int]:
    """Indexes of the values more than `threshold` percent above the median of the finite values
    (none when fewer than two are finite: nothing to compare with)."""
    finite = [v for v in values if not math.isnan(v)]
    if len(finite) < 2:
        return []
    median = statistics.median(finite)
    return [i for i, v in enumerate(values) if v > median * (1 + threshold / 100)]


def excess(values: Sequence[float], i: int) -> float:
    """Percent by which values[i] exceeds the median of the finite values."""
    median = statistics.median(v for v in values if not math.isnan(v))
    return (values[i] / median - 1) * 100


def problems(r: Report) -> list[str]:
    """One sentence per flagged rank, link, or wrong all-reduce."""
    n, out = len(r.hosts), []
    for i in over_median(r.gemm, r.threshold):
        out.append(f"rank {i} ({r.hosts[i]}): GEMM {r.gemm[i] * 1e3:.3g} ms is {excess(r.gemm, i):.0f}% over "
                   f"the median {statistics.median(r.gemm) * 1e3:.3g} ms")
    for i in over_median(r.link, r.threshold):
        j = (i + 1) % n
        out.append(f"link {i}→{j} ({r.hosts[i]}→{r.hosts[j]}): {r.plan.link / r.link[i] / 1e9:.3g} GB/s, "
                   f"its time {excess(r.link, i):.0f}% over the median link")
    for t in r.allreduce:
        out += [f"all_reduce of {row.size} B over the world: {row.out_of_place.wrong} wrong element(s)"
                for row in t.rows if row.out_of_place.wrong]
    return out


def run_preflight(device: torch.device, threshold: float = 20.0) -> Report:
    """All-reduces, ring links and GEMMs over the world; the report (same on every rank). Collective."""
    plan, world = plan_for(device), dist.get_world_size()
    tables = []
    if world > 1:
        everyone = GroupSet("world", (tuple(range(world)),))
        tables = [measure("all_reduce", everyone, [s], torch.float32, device, plan.warmup, plan.iters)
                  for s in (plan.small, plan.large)]
    link = link_seconds(plan, device)
    world_barrier(device)
    gemm = gemm_seconds(plan, device)
    every = gather_world([gemm, link], device)
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    report = Report(plan, threshold, hosts, every[:, 0].tolist(), every[:, 1].tolist(), tables)
    report.problems = problems(report)
    return report


def figures(r: Report) -> dict[str, Any]:
    """The report as JSON (`hybrid-commbench --preflight --save`): the world's larger all-reduce (what a training
    run's `health.comm_preflight` quotes beside its alerts; None in a world of one), every link and GEMM time."""
    rows = [row for t in r.allreduce for row in t.rows]
    big = max(rows, key=lambda row: row.size) if rows else None
    allreduce = {"bytes": big.size, "busbw_gbps": big.out_of_place.busbw} if big else None
    return {"world": len(r.hosts), "hosts": r.hosts, "allreduce": allreduce, "link_bytes": r.plan.link,
            "link_s": r.link, "gemm_s": r.gemm, "problems": r.problems}


def render(r: Report, backend: str, device: torch.device) -> str:
    """The header, the all-reduce lines, one row per rank (its GEMM, its outgoing link) and the verdict."""
    p, n = r.plan, len(r.hosts)
    dtype = str(p.dtype).removeprefix("torch.")
    lines = [f"# preflight: {n} rank(s), {backend} on {device.type}; GEMM {p.gemm}×{p.gemm} {dtype}, ring links "
             f"{p.link} B per message, all-reduce {p.small} B and {p.large} B; medians of {p.iters} iterations; "
             f"flagged: more than {r.threshold:g}% over the median time"]
    for t in r.allreduce:
        c = t.rows[0].out_of_place
        lines.append(f"# all_reduce {t.rows[0].size:>10} B: {c.time_max * 1e6:10.1f} us (slowest rank), "
                     f"busbw {c.busbw:.3g} GB/s, #wrong {c.wrong}")
    flops = 2 * p.gemm ** 3
    gemm_flags, link_flags = set(over_median(r.gemm, r.threshold)), set(over_median(r.link, r.threshold))
    lines.append(f"# {'rank':>4}  {'host':<16} {'GEMM ms':>9} {'TFLOP/s':>8} {'vs med':>7}  "
                 f"{'link':>7} {'ms':>8} {'GB/s':>7} {'vs med':>7}  flag")
    for i in range(n):
        gemm = f"{r.gemm[i] * 1e3:9.3f} {flops / r.gemm[i] / 1e12:8.3f} {_vs(r.gemm, i):>7}"
        link = f"{'-':>7} {'-':>8} {'-':>7} {'-':>7}" if math.isnan(r.link[i]) else (
            f"{f'{i}→{(i + 1) % n}':>7} {r.link[i] * 1e3:8.3f} {p.link / r.link[i] / 1e9:7.3f} {_vs(r.link, i):>7}")
        flag = " ".join(w for w, on in (("GEMM", i in gemm_flags), ("LINK", i in link_flags)) if on)
        lines.append(f"  {i:>4}  {r.hosts[i][:16]:<16} {gemm}  {link}  {flag}".rstrip())
    lines.append(verdict(r))
    return "\n".join(lines)


def _vs(values: Sequence[float], i: int) -> str:
    return f"{excess(values, i):+.0f}%" if len(values) > 1 else "-"


def verdict(r: Report) -> str:
    """The last line: healthy, or every problem found."""
    n = len(r.hosts)
    if r.healthy:
        what = "nothing to compare in a world of one" if n == 1 else (
            f"GEMMs and {n} ring links within {r.threshold:g}% of the median, all-reduces correct")
        return f"preflight: healthy ({n} rank(s): {what})"
    return f"preflight: {len(r.problems)} problem(s): " + "; ".join(r.problems)
