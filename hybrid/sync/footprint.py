"""What a sync mode holds on a rank beyond synchronous DP: the memory estimate's sync terms (`hybrid.memory`).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from hybrid.config import optimizer_moments
from hybrid.sync.gossip import neighbours
from hybrid.sync.outer import largest_share

if TYPE_CHECKING:
    import torch

    from hybrid.config import Config

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


def footprint(cfg: Config, params: Sequence[torch.Tensor], dp: int, share: int, device: str, host: bool = True
              ) -> Footprint:
    """The terms of `cfg.sync.mode` for a rank training `params` (in the model's order; meta tensors will do),
    `dp` replicas, `share` DP ranks in its node (scope=inter's split) on `device`; `host`: it hosts a
    parameter-server shard."""
    sizes = [p.numel() for p in params]
    s, numel = cfg.sync, sum(sizes)
    if s.mode == "diloco":
        r = share if s.scope == "inter" else 1
        mine = largest_share(sizes, r)  # the outer exchange's elements on the rank with the most
        outer = (1 + (s.outer_momentum > 0)) * F32 * numel
        in_flight = F32 * mine if s.overlap_steps else 0  # overlapped: held across steps (at most all of it)
        landing = (0 if s.overlap_steps else mine) + (numel if r > 1 else 0)  # the share itself: in flight
        return Footprint(outer, False, in_flight, F32 * landing, (mine, dp // r))
    if s.mode == "gossip":
        peers = max(len(neighbours(s.topology, dp, i)) for i in range(dp))
        return Footprint(transient=(2 * peers + 3) * F32 * numel if dp > 1 else 0)
    if s.mode == "ps":
        return Footprint(0, True, server_bytes(cfg, numel, dp) if device == "cpu" and host else 0,
                         4 * F32 * numel if device == "cpu" else 0)
    return Footprint()


def server_bytes(cfg: Config, numel: int, dp: int) -> int:
    """A server shard's host (the largest shard): parameters, moments, k + 1 snapshots, the queued pushes of
    k + 1 clocks from every worker (each with its 4-element header) and the step's mean."""
    s, shard = cfg.sync, -(-numel // cfg.sync.servers)
    k = s.max_staleness if s.asynchronous else 0
    return F32 * (shard * (1 + optimizer_moments(cfg.optim) + (k + 1) + 1) + (k + 1) * dp * (shard + 4))
