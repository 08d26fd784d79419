"""The benchmarks' emulated slow link between nodes (`hybrid.bench.emulated_link`) on 4 gloo ranks as 2 nodes × 2.

References: the exchanged values against the math (a sum, the sent tensor); a crossing exchange's completion
against its launch plus the ring formula (`plan.cost.collective_s` at the link's bandwidth and latency, a transfer's
latency plus its bytes) — a lower bound by construction, which load can only lengthen, never break; an exchange
inside a node is returned as torch returns it (no wrapper: nothing added to it).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from harness import run_ranks

from hybrid.bench.emulated_link import LateWork, SlowLink, install
from hybrid.plan.cost import collective_s
from hybrid.plan.hardware import Link

LINK = SlowLink(per_node=2, busbw=1e6, latency=0.02)


def _checks(rank: int, world: int) -> dict[str, object]:
    install(LINK)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    t = torch.full((1000,), float(rank))
    start = time.perf_counter()
    dist.all_reduce(t)  # the world: crosses
    world_s = time.perf_counter() - start
    inside = dist.all_reduce(torch.ones(4), group=pairs[rank // 2], async_op=True)
    inside.wait()
    x = torch.full((500,), float(rank))
    start = time.perf_counter()
    late = dist.all_reduce(x, group=across[rank % 2], async_op=True)
    late.wait()
    waited = time.perf_counter() - start
    y = torch.full((500,), float(rank))
    fut = dist.all_reduce(y, group=across[rank % 2], async_op=True)
    value = fut.get_future().wait()[0]
    future_late = time.perf_counter() >= fut.deadline
    peer = (rank + 2) % 4
    got = torch.empty(250)
    start = time.perf_counter()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((250,), float(rank)), peer),
                                    dist.P2POp(dist.irecv, got, peer)])
    for w in works:
        w.wait()
    p2p_s = time.perf_counter() - start
    return {"sum": t[0].item(), "world_s": world_s, "inside_plain": not isinstance(inside, LateWork),
            "late": isinstance(late, LateWork), "waited": waited, "pair_sum": x[0].item(), "future": value[0].item(),
            "future_late": future_late, "got": got[0].item(), "p2p_late": all(isinstance(w, LateWork) for w in works),
            "p2p_s": p2p_s}


def test_crossing_exchanges_take_the_links_time_and_inside_ones_are_untouched() -> None:
    link = Link(LINK.busbw, LINK.latency)
    for rank, got in enumerate(run_ranks(_checks, 4, timeout=120)):
        assert got["sum"] == 0 + 1 + 2 + 3
        assert got["world_s"] >= collective_s("all_reduce", 4000, 4, link)  # 6 hops + 1.5 × 4000 B at 1 MB/s
        assert got["inside_plain"] and got["late"] and got["p2p_late"]
        assert got["waited"] >= collective_s("all_reduce", 2000, 2, link)
        assert got["pair_sum"] == got["future"] == rank % 2 + rank % 2 + 2
        assert got["future_late"]
        assert got["got"] == (rank + 2) % 4
        assert got["p2p_s"] >= LINK.transfer_s(1000)
