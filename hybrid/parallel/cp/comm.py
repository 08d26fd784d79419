"""The CP ring's communication: tensors passed one hop around the CP group, asynchronously.

`Ring.start(tensors)` posts, as one `batch_isend_irecv`, a send of each tensor to the next CP rank and a receive
of the same shape from the previous one, and returns at once: the caller computes on the block in hand while
the next travels (ring attention's overlap), then `Hop.wait()` returns what arrived. Sends are counted (op
`ring`, per tensor, under the group's name, "cp") and each transfer is timed from its launch to its completion
under `C.TIMER`; the wait itself is the group's exposed time.
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
    sent: list[torch.Tensor]  # kept alive until the sends complete
    received: list[torch.Tensor]
    works: list[tuple[Any, ...]] = field(default_factory=list)  # (work, span, watched)

    def wait(self) -> list[torch.Tensor]:
        """Wait for this hop's sends and receives; the tensors received from the previous rank."""
        with C.TIMER.waiting(self.name, "ring"):
            for work, span, watched in self.works:
                span.wait(work, watched)
        self.works, self.sent = [], []
        return self.received


class Ring:
    """One hop around `group`: to CP rank + 1, from CP rank − 1."""

    def __init__(self, group: Group) -> None:
        self.group, self.name = group, C.group_name(group)
        n, r = C.size(group), C.rank(group)
        self.next, self.prev = (r + 1) % n, (r - 1) % n

    def start(self, tensors: list[torch.Tensor]) -> Hop:
        """Post the hop of `tensors` (sent as they are now: do not change them until `wait`)."""
        sends = [t.contiguous() for t in tensors]
        hop = Hop(self.name, sends, [torch.empty_like(t) for t in sends])
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev) for t in hop.received]
        for t in sends:
            C.COUNTER.record(self.name, "ring", t, C.size(self.group))
        start = C.TIMER.mark()
        for work in dist.batch_isend_irecv(ops):
            hop.works.append((work, *C.TIMER.launched(self.name, "ring", work, start)))
        return hop
