"""The link inside a node of CPU ranks, measured as a step meets it (`hybrid-plan --calibrate cpu`,
`python -m hybrid.bench.plan_cpu`).

Gloo ranks on this machine, every node's at once: the bus bandwidth of a 16 MiB all-reduce over the node's ranks;
a 4-byte all-reduce's time a hop, idle; and a hop's time under load — the ranks in pairs alternate a GEMM of the
model's MLP shape with all-gathers of a microbatch's hidden states (TP's exchange) in their pair, against the same
GEMMs alone, less the bytes' time. With more ranks than cores a hop also waits for its partner to be scheduled (each
rank's core runs others' GEMMs meanwhile): the latency TP's and PP's exchanges meet inside a step, milliseconds
where the idle hop takes tens of microseconds. The link's latency is the larger of the two.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.plan.hardware import Link
from hybrid.testing.ranks import launch


def measure(ranks: int, hidden: int, tokens: int, timeout: float = 300.0) -> dict[str, float]:
    """The link among `ranks` gloo ranks forked here (one node): `probe`'s figures."""
    return launch(_rank, ranks, hidden, tokens, timeout=timeout)[0]


def link_of(probed: dict[str, float]) -> Link:
    return Link(probed["busbw"], probed["latency"])


def _rank(rank: int, world: int, hidden: int, tokens: int) -> dict[str, float]:
    return probe(None, hidden, tokens)


def node_group(world: int, per_node: int) -> Any:
    """This rank's node's ranks as a group (every rank creates every node's group); None: the world."""
    if per_node in (1, world):
        return None
    groups = [dist.new_group(list(range(k, k + per_node))) for k in range(0, world, per_node)]
    return groups[dist.get_rank() // per_node]


def probe(node: Optional[Any], hidden: int, tokens: int) -> dict[str, float]:
    """Run on every rank (collective): busbw (B/s) over `node`'s ranks, the idle hop's and the loaded hop's seconds,
    and `latency`, the larger."""
    n, big, tiny = dist.get_world_size(node), torch.ones(4 * 2**20), torch.ones(1)
    dist.all_reduce(big, group=node)
    start = time.perf_counter()
    dist.all_reduce(big, group=node)
    busbw = 2 * (n - 1) / n * big.numel() * 4 / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(tiny, group=node)
    idle = (time.perf_counter() - start) / 10 / (2 * (n - 1))
    loaded = loaded_hop(hidden, tokens, busbw)
    return {"busbw": busbw, "idle_latency": idle, "loaded_latency": loaded, "latency": max(idle, loaded)}


def loaded_hop(hidden: int, tokens: int, busbw: float, iters: int = 16, hops: int = 4, rounds: int = 5) -> float:
    """Seconds a hop takes beyond its bytes while every rank computes (see the module doc): `rounds` alternating runs
    of `iters` GEMMs (a microbatch's tokens × hidden × 4·hidden, the MLP's) each followed by `hops` exchanges, and of
    the GEMMs alone; the median difference an exchange, less its bytes at `busbw`. A waiting rank frees its core
    for the others' GEMMs, so only what the waits cost the whole machine counts — not each wait's own length."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    pair = pairs[rank // 2] if rank // 2 < len(pairs) else None
    x, w = torch.randn(tokens, hidden), torch.randn(4 * hidden, hidden)
    half = torch.ones(tokens * hidden // 2)
    got = [torch.empty_like(half), torch.empty_like(half)]

    def run(exchange: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            torch.nn.functional.linear(x, w)
            for _ in range(hops if exchange and pair is not None else 0):
                dist.all_gather(got, half, group=pair)
        dist.barrier()
        return time.perf_counter() - start

    run(True)
    extra = statistics.median(run(True) - run(False) for _ in range(rounds)) / (iters * hops)
    return extra - half.numel() * 4 / busbw
