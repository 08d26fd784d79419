"""All-to-all context parallelism (DeepSpeed-Ulysses): attention on whole sequences of 1/cp of the heads.

Before attention, one all-to-all per tensor turns this rank's tokens of every head (the load-balanced layout of
`sharding`) into every token of its 1/cp of the heads (`seq_to_heads`); the attention is then plain causal
`scaled_dot_product_attention` over the whole sequence (any kernel, dropout included); one all-to-all turns the
output back (`heads_to_seq`). Each is the other's backward. Query heads must divide by cp; grouped K/V heads
travel as they are when they divide by cp too (rank r then holds query heads r·h/cp… and exactly the K/V heads
serving them), else they are repeated to one per query head first. Bytes per rank and layer: forward one
all-to-all of q, k, v and the output each, backward the same.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.cp.sharding import shard, unshard


def seq_to_heads(t: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h, s/cp, d] (this rank's tokens) → [b, h/cp, s, d] (this rank's heads, the sequence in order)."""
    cp = C.size(group)
    b, h, s, d = t.shape
    inp = t.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # piece j: head group j, for rank j
    out = torch.empty_like(inp)
    C.all_to_all(out, inp, group)  # out[i]: rank i's tokens of this rank's heads
    return unshard(list(out.unbind(0)), dim=2)


def heads_to_seq(t: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h/cp, s, d] (this rank's heads) → [b, h, s/cp, d] (this rank's tokens of every head)."""
    cp = C.size(group)
    inp = torch.stack([shard(t, cp, j, dim=2) for j in range(cp)])  # piece j: rank j's tokens
    out = torch.empty_like(inp)
    C.all_to_all(out, inp, group)  # out[i]: head group i, this rank's tokens
    b, h, s, d = out.shape[1:]
    # [b, s, heads, d] in memory, as SDPA's output: the output projection's [b, s, heads·d] input is then a view
    return out.permute(1, 3, 0, 2, 4).reshape(b, s, cp * h, d).transpose(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, dropout_p: float = 0.0,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this CP rank's tokens (q [b, h, s/cp, d], k and v [b, hk, s/cp, d]) over the whole
    sequence, by all-to-all over heads: equal to whole-sequence SDPA, sharded."""
    cp, heads = C.size(group), q.shape[1]
    if heads % cp:
        raise ValueError(f"all-to-all context parallelism needs the attention heads ({heads}) divisible by cp={cp}")
    if k.shape[1] % cp:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (C.conjugate(t, group, seq_to_heads, heads_to_seq) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return C.conjugate(y, group, heads_to_seq, seq_to_heads)
