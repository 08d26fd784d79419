"""A parameter server's shard (`sync=ps`): the thread on a DP rank that holds a contiguous shard of its
coordinate's parameters and their optimizer, collects every worker's pushes per clock, steps on their mean and
answers each push with the parameters of exactly the version it needs (`ps.py` has the protocol).
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.config import Config
from hybrid.optim.adamw import optimizer_over

STOP = -1.0


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """The S contiguous [lo, hi) shards of a flat vector of `numel` elements (sizes differ by at most one)."""
    return [(s * numel // servers, (s + 1) * numel // servers) for s in range(servers)]


class Server:
    """Shard `bounds` of one coordinate's parameters and its optimizer; `run` is the thread's loop."""

    def __init__(self, cfg: Config, params: list[nn.Parameter], flat: torch.Tensor, bounds: tuple[int, int],
                 workers: int, push: dist.ProcessGroup, pull: dist.ProcessGroup, me: int) -> None:
        self.s, self.workers, self.push, self.pull, self.me = cfg.sync, workers, push, pull, me
        lo, hi = bounds
        self.slices: list[nn.Parameter] = []
        decay, plain, offset = [], [], 0
        for p in params:  # the shard's part of each parameter, a leaf of its own (decay as the parameter's)
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                piece = nn.Parameter(flat[a:b].clone())
                self.slices.append(piece)
                (decay if p.ndim >= 2 else plain).append(piece)
            offset += p.numel()
        self.optimizer = optimizer_over([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                         {"params": plain, "weight_decay": 0.0}], cfg.optim, cfg.train.lr)
        self.numel, self.version = hi - lo, 0
        self.keep = cfg.sync.max_staleness if cfg.sync.asynchronous else 0
        self.snapshots: dict[int, torch.Tensor] = {0: self.params()}  # version → the shard's parameters
        self.pushes: dict[int, dict[int, tuple[torch.Tensor, int, float]]] = defaultdict(dict)
        self.waiting: list[tuple[int, int]] = []  # (worker, the version it needs) owed a reply
        self.staleness: list[int] = []  # every applied push's
        self.inbox: queue.Queue = queue.Queue()  # (worker, push): the host's own worker's and `receive`'s
        self.local_out: queue.Queue = queue.Queue()  # replies to the host's own worker
        self.changed = threading.Condition()
        self.error: Optional[BaseException] = None

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.slices])

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the worker raises it at its next exchange
            self.error = e
            self.local_out.put(None)
            with self.changed:
                self.changed.notify_all()

    def _loop(self) -> None:
        """Handle pushes from the inbox (the host's own worker puts its own there; `receive` the others') until
        every worker has said stop; reply as versions allow."""
        stopped = 0
        while stopped < self.workers:
            stopped += self._handle(*self.inbox.get())

    def receive(self) -> None:
        """The receiving thread's loop: every remote worker's pushes (an any-source receive on the push group,
        blocking) into the inbox, until each has sent its stop."""
        try:
            left, buf = self.workers - 1, torch.empty(4 + self.numel)
            while left:
                src = dist.recv(buf, group=self.push)
                left -= int(float(buf[0]) == STOP)
                self.inbox.put((dist.get_group_rank(self.push, src), buf.clone()))
        except BaseException as e:  # noqa: BLE001 - the worker raises it at its next exchange
            self.error = e
            self.local_out.put(None)

    def _handle(self, worker: int, msg: torch.Tensor) -> int:
        """One push: kept for its clock; the versions it completes applied; replies sent. 1 for a stop."""
        clock, version, lr, need = float(msg[0]), int(msg[1]), float(msg[2]), int(msg[3])
        if clock == STOP:
            return 1
        self.pushes[int(clock)][worker] = (msg[4:], int(clock) - version, lr)
        self.waiting.append((worker, need))
        while len(self.pushes.get(self.version, {})) == self.workers:
            self._apply(self.pushes.pop(self.version))
        self._answer()
        return 0

    @torch.no_grad()
    def _apply(self, pushes: dict[int, tuple[torch.Tensor, int, float]]) -> None:
        """One optimizer step on the clock's mean gradient (DP-rank order), then the next version."""
        mean = torch.zeros(self.numel)
        for w in sorted(pushes):  # the sum, then one division: as the DP all-reduce's mean
            grad, stale, lr = pushes[w]
            mean.add_(grad, alpha=1.0 / (1 + stale) if self.s.staleness_weighting else 1.0)
            self.staleness.append(stale)
        mean.div_(self.workers)
        offset = 0
        for piece in self.slices:
            piece.grad = mean[offset: offset + piece.numel()].view_as(piece)
            offset += piece.numel()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with self.changed:
            self.version += 1
            self.snapshots[self.version] = self.params()
            for old in [v for v in self.snapshots if v < self.version - self.keep]:  # no push needs them now
                del self.snapshots[old]
            self.changed.notify_all()

    def _answer(self) -> None:
        """Reply to every push whose needed version is reached: [that version] and the shard's parameters then —
        exactly that version, so every shard of a replica (and its TP and PP peers) computes on one model, and
        an asynchronous run repeats bit for bit whatever the timing."""
        due = [(w, need) for w, need in self.waiting if need <= self.version]
        self.waiting = [x for x in self.waiting if x not in due]
        for w, need in due:
            reply = torch.cat([torch.tensor([float(need)]), self.snapshots[need]])
            if w == self.me:
                self.local_out.put(reply)
            else:  # its receive was posted before its push: the send completes (the worker counts what it receives)
                dist.send(reply, group=self.pull, group_dst=w)

    def wait_version(self, version: int) -> None:
        with self.changed:
            while self.version < version and self.error is None:
                self.changed.wait(timeout=1.0)
        if self.error is not None:
            raise RuntimeError(f"parameter server thread failed: {self.error}") from self.error
