"""The model's side of context parallelism (`parallel.cp`): this rank's true positions, its attention over the
whole sequence.

A CP rank holds the load-balanced two chunks of every sequence (`hybrid.parallel.cp.sharding`): its learned
positions and RoPE angles follow each token's index in the whole sequence, and its attention runs over every
rank's keys by the ring (`parallel.cp_comm=ring`: K/V passed around the CP group) or by all-to-all over heads
(`a2a`). Everything else in a block is per token and runs on the local tokens as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.cp.ring import ring_attention
from hybrid.parallel.cp.sharding import positions
from hybrid.parallel.cp.ulysses import ulysses_attention
from hybrid.parallel.rng import derive_seed

COMMS = ("ring", "a2a")


@dataclass(frozen=True)
class ContextParallel:
    """The CP group and its exchange (`parallel.cp_comm`)."""

    group: Group
    comm: str = "ring"

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The whole-sequence indices of this rank's `local` tokens."""
        cp = C.size(self.group)
        return positions(local * cp, cp, C.rank(self.group), device)

    def stream_seed(self, seed: int) -> int:
        """A dropout stream's seed made this CP rank's own: its tokens are not its CP peers'."""
        return derive_seed(seed, "cp", C.rank(self.group))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Causal attention of the local queries [b, h, s/cp, d] over the whole sequence, `dropout_p` on its
        probabilities (drawn from the caller's stream: the TP rank's, forked)."""
        if self.comm == "ring":
            return ring_attention(q, k, v, self.group, dropout_p)
        return ulysses_attention(q, k, v, self.group, dropout_p)
