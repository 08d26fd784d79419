"""What a sync mode holds on a rank: the memory estimate's sync terms (`hybrid.memory`), in bytes (fp32
elements of the rank's trained parameters). Each mode's `footprint` says what it counts (`dp.py`: the
exchange's copies in flight and the codec's state; `diloco.py`: anchors, momentum and the pseudo-gradient;
`gossip.py`: a round's flat copies; `ps.py`: the push buffers and the server shard's host)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

F32 = 4


@dataclass(frozen=True)
class Footprint:
    """A sync mode's bytes on one rank. `outer_optimizer`: optimizer state beside the inner optimizer's;
    `no_inner`: the rank holds no inner optimizer (its state lives on the servers); `state`: kept across steps;
    `transient`: held while an exchange runs (after the backward: the activations are freed); `outer`:
    (elements, group size) the outer exchange sends through the compression hook (None: no hook)."""

    outer_optimizer: int = 0
    no_inner: bool = False
    state: int = 0
    transient: int = 0
    outer: Optional[tuple[int, int]] = None

    def terms(self, inner_optimizer: int, codec: Callable[[int, int], int]) -> tuple[int, int, int]:
        """(optimizer, exchange buffers, state) for the estimate; `codec(elements, group size)`: the state the
        compression hook keeps for an exchange of that many elements over that many ranks."""
        optimizer = 0 if self.no_inner else inner_optimizer + self.outer_optimizer
        return optimizer, self.transient, self.state + (codec(*self.outer) if self.outer else 0)
