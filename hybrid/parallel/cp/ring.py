"""Ring attention over the CP group: causal self-attention of a sequence split load-balanced over CP ranks.

Each rank holds its two chunks of the queries, keys and values (`sharding`). Forward: cp steps; at step j the
rank holds the K/V of CP rank r−j and, while attending to them, already passes them on to rank r+1 and
receives rank r−j−1's (`comm.Ring`: async point-to-point, cp−1 hops of K and V). Each pair of a query chunk
and a key chunk is attended in full (keys wholly before), causally (the same chunk) or skipped (keys wholly
after): two or three blocks a step on every rank, the same work everywhere. The partial results merge by their
log-sum-exps (`blocks.merge`), so the output is the whole sequence's softmax exactly.

Backward: the K/V blocks go around again, each followed by its gradient: at step j a rank adds its queries'
share of block r−j's dK/dV to what arrived from rank r−1 (who computed its share one step earlier) and sends
the sum on; after the last step each block's dK/dV, summed over every rank, arrives back at its owner (cp−1 hops
of K/V and cp of dK/dV, fp32). dQ stays local. Bytes per rank and layer: forward (cp−1)·2·|kv|, backward
(cp−1)·2·|kv| + cp·2·|kv|₃₂.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.cp import blocks
from hybrid.parallel.cp.comm import Hop, Ring
from hybrid.parallel.cp.sharding import chunks_of


def _pairs(cp: int, rank: int, src: int) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) of every block this rank attends while holding `src`'s K/V."""
    mine, theirs = chunks_of(cp, rank), chunks_of(cp, src)
    return [(i, j, kc == qc) for i, qc in enumerate(mine) for j, kc in enumerate(theirs) if kc <= qc]


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return t.chunk(2, dim=2)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float) -> blocks.Partial:
    """(output, log-sum-exp) of this rank's queries over the whole sequence, fp32."""
    cp, rank = C.size(ring.group), C.rank(ring.group)
    acc: list[Optional[blocks.Partial]] = [None, None]
    kv, qs = (k, v), _halves(q)
    for step in range(cp):
        hop = ring.start(list(kv)) if step < cp - 1 else None
        ks, vs = _halves(kv[0]), _halves(kv[1])
        for i, j, causal in _pairs(cp, rank, (rank - step) % cp):
            acc[i] = blocks.merge(acc[i], blocks.forward(qs[i], ks[j], vs[j], causal, scale))
        kv = tuple(hop.wait()) if hop else kv
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)  # type: ignore[index]


def _backward(dout: torch.Tensor, saved: tuple[torch.Tensor, ...], ring: Ring, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) fp32 of this rank's chunks; the K/V blocks and their gradients travel the ring."""
    q, k, v, out, lse = saved
    cp, rank = C.size(ring.group), C.rank(ring.group)
    delta = (dout * out).sum(dim=-1)
    qs, douts, deltas, lses = _halves(q), _halves(dout), _halves(delta), _halves(lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqs, kv, grads_in = _halves(dq), (k, v), None
    for step in range(cp):
        hop = ring.start(list(kv)) if step < cp - 1 else None
        dk, dv = torch.zeros_like(kv[0], dtype=torch.float32), torch.zeros_like(kv[1], dtype=torch.float32)
        ks, vs, dks, dvs = _halves(kv[0]), _halves(kv[1]), _halves(dk), _halves(dv)
        for i, j, causal in _pairs(cp, rank, (rank - step) % cp):
            grads = blocks.backward(douts[i], deltas[i], qs[i], ks[j], vs[j], lses[i], causal, scale)
            for total, part in zip((dqs[i], dks[j], dvs[j]), grads):
                total.add_(part)
        grads_in = _pass_on(ring, grads_in, dk, dv)
        kv = tuple(hop.wait()) if hop else kv
    dk, dv = grads_in.wait() if cp > 1 else (dk, dv)  # type: ignore[union-attr]
    return dq, dk, dv


def _pass_on(ring: Ring, arriving: Optional[Hop], dk: torch.Tensor, dv: torch.Tensor) -> Optional[Hop]:
    """Add the block's dK/dV from the previous rank to this rank's share and send the sum to the next."""
    if C.size(ring.group) == 1:
        return None
    for total, before in zip((dk, dv), arriving.wait() if arriving is not None else ()):
        total.add_(before)
    return ring.start([dk, dv])


class _RingAttention(torch.autograd.Function):
    """q [b, h, s/cp, d], k and v [b, hk, s/cp, d] (this rank's two chunks) → causal attention output, q's dtype."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,  # noqa: ANN001
                scale: float) -> torch.Tensor:
        ctx.ring, ctx.scale = Ring(group), scale
        out, lse = _forward(q, k, v, ctx.ring, scale)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] in memory, as SDPA's: the output
        ctx.save_for_backward(q, k, v, out, lse)  # projection's [b, s, h·d] input is then a view, not a copy
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = _backward(grad.float(), ctx.saved_tensors, ctx.ring, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (load-balanced layout, `sharding`):
    equal to `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on the whole sequence, sharded."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens (two chunks), got {q.shape[2]}")
    return _RingAttention.apply(q, k, v, group, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
