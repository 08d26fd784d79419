"""Emulated nodes joined by a slowed link, for benchmarks on one machine.

`install(SlowLink(per_node, busbw, latency))`, in each rank process before its first exchange, makes every
collective whose group holds ranks of two emulated nodes (`per_node` consecutive ranks a node, as
`parallel.ranks_per_node` lays them out), and every point-to-point transfer between two nodes, complete no sooner
than a link of that bus bandwidth and hop latency would carry it: a ring's hops and bus bytes (`plan.cost`'s
`collective_s`, nccl-tests' factors: 2(n − 1)/n of the payload for an all-reduce, (n − 1)/n for the others), a
transfer's latency plus its bytes — counted from the launch or, while this rank's earlier crossing transfers still
hold its link, from their end (one at a time, as one NIC carries them). The wait happens where the caller waits — a
blocking call returns late, an async one's `wait()` and future complete late — so a transfer overlaps whatever its
rank runs meanwhile, as on a real link, and a waiting rank leaves its core to the others. The real exchange still
runs over loopback underneath: its own time counts when it is the longer. Exchanges inside a node are untouched.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.plan.cost import collective_s
from hybrid.plan.hardware import Link

_BUSY_UNTIL = [0.0]  # when this rank's link to the other nodes is free again
#: the wrapped collectives and how each one's payload (the bytes the ring formula takes) is read from its arguments
PAYLOAD: dict[str, Callable[[inspect.BoundArguments], float]] = {
    "all_reduce": lambda a: _bytes(a.arguments["tensor"]),
    "broadcast": lambda a: _bytes(a.arguments["tensor"]),
    "all_gather": lambda a: sum(_bytes(t) for t in a.arguments["tensor_list"]),
    "reduce_scatter": lambda a: sum(_bytes(t) for t in a.arguments["input_list"]),
    "all_gather_into_tensor": lambda a: _bytes(a.arguments["output_tensor"]),
    "reduce_scatter_tensor": lambda a: _bytes(a.arguments["input"]),
    "all_to_all_single": lambda a: _bytes(a.arguments["input"]),
}
PAYLOAD |= {"all_gather_single": PAYLOAD["all_gather_into_tensor"],
            "reduce_scatter_single": PAYLOAD["reduce_scatter_tensor"]}


@dataclass(frozen=True)
class SlowLink:
    """The link between emulated nodes of `per_node` ranks: bus bandwidth (B/s) and a hop's latency (s)."""

    per_node: int
    busbw: float
    latency: float

    def deadline(self, seconds: float) -> float:
        """When a transfer of `seconds` launched now completes: after those this rank launched before it (its link
        carries one transfer at a time, first in first out)."""
        start = max(time.perf_counter(), _BUSY_UNTIL[0])
        _BUSY_UNTIL[0] = start + seconds
        return _BUSY_UNTIL[0]

    def crosses(self, ranks: list[int]) -> bool:
        return len({r // self.per_node for r in ranks}) > 1

    def collective_s(self, op: str, payload: float, n: int) -> float:
        return collective_s(op if op == "all_reduce" else "all_gather", payload, n,
                            Link(self.busbw, self.latency))

    def transfer_s(self, nbytes: float) -> float:
        return self.latency + nbytes / self.busbw


class LateWork:
    """A work (or its future) that completes no sooner than `deadline` (`time.perf_counter()` seconds)."""

    def __init__(self, work: Any, deadline: float) -> None:
        self.work, self.deadline = work, deadline

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        _sleep_until(self.deadline)
        return done

    def get_future(self) -> torch.futures.Future:
        deadline = self.deadline
        return self.work.get_future().then(lambda f: (_sleep_until(deadline), f.value())[1])

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def install(link: SlowLink) -> None:
    """Wrap torch.distributed's collectives and `batch_isend_irecv` (and hybrid's bound copies) for this process."""
    for name in [n for n in PAYLOAD if hasattr(dist, n)]:
        setattr(dist, name, _collective(link, name, getattr(dist, name)))
    dist.batch_isend_irecv = _batch(link, dist.batch_isend_irecv)
    C.dist_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    C.dist_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(link: SlowLink, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if not link.crosses(ranks):
            return original(*args, **kwargs)
        deadline = link.deadline(link.collective_s(name, PAYLOAD[name](bound), len(ranks)))
        return _late(original(*args, **kwargs), deadline, bool(bound.arguments.get("async_op")))

    return call


def _batch(link: SlowLink, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(ops: list[dist.P2POp]) -> Any:
        far = [op for op in ops if link.crosses([dist.get_rank(), _peer(op)])]
        sent = sum(_bytes(op.tensor) for op in far if op.op is dist.isend)
        deadline = link.deadline(link.transfer_s(max(sent, sum(_bytes(op.tensor) for op in far) - sent)))
        works = original(ops)
        return [LateWork(w, deadline) for w in works] if far else works

    return call


def _peer(op: dist.P2POp) -> int:
    """The op's peer as a global rank."""
    peer = getattr(op, "peer", None)
    return peer if peer is not None else dist.get_global_rank(op.group, op.group_peer)


def _late(result: Any, deadline: float, async_op: bool) -> Any:
    if async_op:
        return LateWork(result, deadline)
    _sleep_until(deadline)
    return result


def _bytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.perf_counter()))
