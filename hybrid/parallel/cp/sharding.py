"""The load-balanced layout of a sequence over the CP group (Megatron-LM's causal sharding).

The sequence is cut into 2·cp equal chunks; CP rank i holds chunks i and 2·cp−1−i, in that order, as one
local sequence of seq_len / cp tokens. Under a causal mask chunk c attends to c+1 chunks' worth of keys, so
the pair (i, 2·cp−1−i) gives every rank 2·cp+1 chunks of work: the same on every rank.
"""

from __future__ import annotations

import torch


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) CP rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def shard(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole sequence `t` (along `dim`, divisible by 2·cp): its two chunks, joined."""
    if cp == 1:
        return t
    parts = t.chunk(2 * cp, dim=dim)
    a, b = chunks_of(cp, rank)
    return torch.cat([parts[a], parts[b]], dim=dim)


def unshard(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's `shard` (by rank): the inverse of `shard`."""
    cp = len(pieces)
    if cp == 1:
        return pieces[0]
    order: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for rank, piece in enumerate(pieces):
        a, b = chunks_of(cp, rank)
        order[a], order[b] = piece.chunk(2, dim=dim)
    return torch.cat(order, dim=dim)


def positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The true indices in the whole sequence of this rank's `seq_len / cp` tokens (learned positions, RoPE)."""
    return shard(torch.arange(seq_len, device=device), cp, rank, dim=0)
