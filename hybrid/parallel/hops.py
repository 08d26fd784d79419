"""Tensors passed one hop around a group, asynchronously: the ring step that CP's ring attention and TP's chunked
overlap share.

`Ring.start(tensors)` posts, as one `batch_isend_irecv`, a send of each tensor to the next rank of the group and a
receive of the same shape from the previous one, and returns at once: the caller computes on the block in hand
while the next travels, then `Hop.wait()` returns what arrived. Each transfer is timed from its launch to its
completion under `C.TIMER`, labelled with the ring's `op` (CP: `ring`; TP: the collective the ring replaces); the
wait itself is the group's exposed time. Sends are counted per tensor under `op` unless the caller counts the
whole exchange itself (`counted=False`: TP counts each ring once, as the collective it replaces).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group


@dataclass
class Hop:
    """One posted hop: the receive buffers and every transfer still in flight."""

    name: str
    op: str
    sent: list[torch.Tensor]  # kept alive until the sends complete
    received: list[torch.Tensor]
    works: list[tuple[Any, ...]] = field(default_factory=list)  # (work, span, watched)

    def wait(self) -> list[torch.Tensor]:
        """Wait for this hop's sends and receives; the tensors received from the previous rank."""
        with C.TIMER.waiting(self.name, self.op):
            for work, span, watched in self.works:
                span.wait(work, watched)
        self.works, self.sent = [], []
        return self.received


class Ring:
    """One hop around `group`: to rank + 1, from rank − 1 (ranks of the group); `op` labels counts and spans."""

    def __init__(self, group: Group, op: str = "ring") -> None:
        self.group, self.name, self.op = group, C.group_name(group), op
        n, r = C.size(group), C.rank(group)
        self.next, self.prev = (r + 1) % n, (r - 1) % n

    def start(self, tensors: list[torch.Tensor], counted: bool = True) -> Hop:
        """Post the hop of `tensors` (sent as they are now: do not change them until `wait`); `counted`: record
        each send in `C.COUNTER` under the ring's op."""
        sends = [t.contiguous() for t in tensors]
        hop = Hop(self.name, self.op, sends, [torch.empty_like(t) for t in sends])
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev) for t in hop.received]
        for t in sends if counted else ():
            C.COUNTER.record(self.name, self.op, t, C.size(self.group))
        start = C.TIMER.mark()
        for work in dist.batch_isend_irecv(ops):
            hop.works.append((work, *C.TIMER.launched(self.name, self.op, work, start)))
        return hop
