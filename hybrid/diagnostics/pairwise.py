"""The measured point-to-point bandwidth between every pair of ranks, as a world × world matrix in GB/s.

Pairs are scheduled in rounds by the circle method of a round-robin tournament: in each round every
rank is in at most one pair (with an odd world one rank sits out), so every link is measured once,
and a world of n takes n − 1 rounds (n with n odd). In a round the two ranks of each pair play
ping-pong with `dist.send` / `dist.recv`: the lower rank (the leader) sends `size` bytes and receives
them back, `warmup` untimed times (NCCL builds the pair's communicator on the first exchange), then
`iters` times, each timed on its own by the leader's clock alone (no clocks need agreeing). Every
round ends with a `dist.barrier` on the whole world: ranks without a pair wait there, and no round
overlaps the next. `serial=True` measures one pair per round instead (no two transfers at once).

A ping-pong iteration moves `size` bytes one way and back, one after the other, so the link's one-way
bandwidth is 2 · size / t for the median iteration time t (the median, not the mean: one descheduled
iteration on a busy host does not move it). That is the algorithm bandwidth of a send, and since
`collectives.bus_factor("send", 2)` is 1 it is also nccl-tests' bus bandwidth, comparable with the
link's peak. Finally one `all_reduce` (sum) of the matrix, where only each link's leader wrote its
cell, gives every rank the full matrix. The diagonal (no link) is NaN.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel.collectives import bus_factor

Matrix = list[list[float]]
Pair = tuple[int, int]
GB = 1e9


def rounds(world: int, serial: bool = False) -> list[list[Pair]]:
    """The pairs (lower rank first) of each round: a round-robin tournament by the circle method
    (rank 0 stays, the others rotate; an odd world adds a bye), or with `serial` one pair a round."""
    if world < 2:
        return []
    ids = list(range(world)) + ([-1] if world % 2 else [])
    n, out = len(ids), []
    for _ in range(n - 1):
        pairs = [(min(ids[i], ids[n - 1 - i]), max(ids[i], ids[n - 1 - i])) for i in range(n // 2)]
        out.append([p for p in pairs if p[0] >= 0])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return [[p] for r in out for p in r] if serial else out


def exchange(buf: torch.Tensor, peer: int, leader: bool) -> None:
    """One ping-pong iteration: the leader sends `buf` to `peer` and receives it back, the peer
    receives it and sends it back (blocking `dist.send` / `dist.recv` on the default group)."""
    if leader:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (NCCL's p2p is asynchronous to the host), nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pair(buf: torch.Tensor, peer: int, leader: bool, iters: int, warmup: int) -> list[float]:
    """Seconds of each of `iters` ping-pong iterations with `peer`, after `warmup` untimed ones (both
    ranks of the pair run it; the leader's times are the measurement). Each iteration waits for the
    device, so on a GPU every time includes one host synchronisation."""
    for _ in range(warmup):
        exchange(buf, peer, leader)
    _sync(buf.device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        exchange(buf, peer, leader)
        _sync(buf.device)
        times.append(time.perf_counter() - start)
    return times


def bandwidth_gbs(size: int, seconds: float) -> float:
    """One-way bandwidth in GB/s (10⁹ bytes/s) of a ping-pong iteration of `seconds`: `size` bytes there
    and back."""
    return 2 * size * bus_factor("send", 2) / max(seconds, 1e-12) / GB


def measure(size: int, iters: int, warmup: int, device: torch.device, serial: bool = False) -> Matrix:
    """The bandwidth matrix in GB/s, on every rank. Collective over the default group: send/recv
    within each pair, a barrier after each round, one all-reduce of the matrix (see the module's doc)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [[math.nan]]
    world, me = dist.get_world_size(), dist.get_rank()
    cells = torch.zeros(world, world, dtype=torch.float64, device=device)
    buf = torch.full((size,), 7, dtype=torch.uint8, device=device)
    for pairs in rounds(world, serial):
        for a, b in pairs:
            if me in (a, b):
                times = time_pair(buf, b if me == a else a, me == a, iters, warmup)
                if me == a:
                    cells[a, b] = cells[b, a] = bandwidth_gbs(size, statistics.median(times))
        dist.barrier()
    dist.all_reduce(cells)
    out = cells.cpu().tolist()
    for r in range(world):
        out[r][r] = math.nan
    return out


def links(matrix: Matrix) -> Iterator[tuple[int, int, float]]:
    """Every measured link (i < j) with its bandwidth."""
    for i, row in enumerate(matrix):
        for j in range(i + 1, len(row)):
            yield i, j, row[j]


def split_links(matrix: Matrix, node_of: list[int]) -> dict[str, list[float]]:
    """The links' bandwidths by class: `intra` (both ranks on one node) and `inter` (across nodes)."""
    out: dict[str, list[float]] = {"intra": [], "inter": []}
    for i, j, bw in links(matrix):
        out["intra" if node_of[i] == node_of[j] else "inter"].append(bw)
    return out


def stats(values: list[float]) -> Optional[dict[str, float]]:
    """min / median / max / count of a class, or None when it has no link."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "count": len(values)}


def summarize(matrix: Matrix, node_of: list[int]) -> dict[str, Optional[dict[str, float]]]:
    """The per-class summary of the matrix: {"intra": stats, "inter": stats}."""
    return {name: stats(values) for name, values in split_links(matrix, node_of).items()}
