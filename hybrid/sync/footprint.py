"""What a sync mode holds on a rank: the memory estimate's sync terms (`hybrid.memory`), as each mode's
`footprint` answers them (synchronous DP: its exchange's copies in flight and its codec's state).

In elements of the rank's trained parameters `numel`, fp32 (4 bytes each):

- `diloco`: the anchors (a copy of the parameters) and, with outer momentum, the momentum (another) — outer
  optimizer state, beside the inner optimizer's; while an outer step runs, the pseudo-gradient of the rank's
  share (about numel / r, r = the node's DP ranks under `sync.scope=inter`, else 1: the largest part of
  `outer.even_parts`'s split) and, when r > 1, the node's combined vector (numel); the outer hook's codec
  state is over the share (`outer`); with `sync.overlap_steps`, the share's pseudo-gradient in flight is held
  across steps (counted whole).
- `gossip`: while a round runs, the flat parameters, each neighbour's, their stack and the mean.
- `ps`: no optimizer on the worker (the servers hold it); on CPU, while it pushes, the flat gradient, the
  pushes, the replies and their concatenation (on CUDA those are host memory); the host of a server shard
  (DP ranks below `sync.servers`, host memory, so CPU runs only) keeps the shard's parameters, its optimizer
  moments, the snapshots of the versions a worker may still need (k + 1) and the pushes of up to k + 1 clocks
  of every worker, plus their mean while it steps.
"""

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
