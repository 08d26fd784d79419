"""Ring attention over the CP group: causal self-attention of a sequence split load-balanced over CP ranks.

Each rank holds its two chunks of the queries, keys and values (`sharding`). Forward: cp steps; at step j the
rank holds the K/V of CP rank r−j and, while attending to them, already passes them on to rank r+1 and
receives rank r−j−1's (`hops.Ring`: async point-to-point, cp−1 hops of K and V). Each pair of a query chunk
and a key chunk is attended in full (keys wholly before), causally (the same chunk) or skipped (keys wholly
after): two or three blocks a step on every rank, the same work everywhere. The partial results merge by their
log-sum-exps (`blocks.merge`), so the output is the whole sequence's softmax exactly.

Backward: the K/V blocks go around again, each followed by its gradient: at step j ≥ 1 a rank adds its
queries' share of block r−j's dK/dV to what arrived from rank r−1 (who computed its share one step earlier)
and sends the sum on; after the last step each block's dK/dV, summed over every other rank, arrives back at its
owner, who adds its own share (cp−1 hops of K/V and cp−1 of dK/dV, fp32). The owner's share is computed in two
parts that hide the ring's two ends: the full pair of its own chunks while the first K/V hop travels, the two
causal pairs while the last dK/dV hop does. dQ stays local. Bytes per rank and layer: forward (cp−1)·2·|kv|,
backward (cp−1)·2·|kv| + (cp−1)·2·|kv|₃₂.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.cp import blocks
from hybrid.parallel.cp.sharding import chunks_of
from hybrid.parallel.hops import Hop, Ring
from hybrid.parallel.rng import derive_seed

Pair = tuple[int, int, bool, Optional[blocks.Drop]]  # query chunk slot, key chunk slot, causal, its dropout


@dataclass(frozen=True)
class _Spec:
    """One ring attention call: the hop, the softmax scale, the dropout rate and the seed of its masks."""

    ring: Ring
    scale: float
    p: float = 0.0
    seed: int = 0

    def pairs(self, src: int) -> list[Pair]:
        """Every block this rank attends while holding CP rank `src`'s K/V: (query slot, key slot, causal,
        dropout seeded by the two chunks' places in the sequence)."""
        cp, rank = C.size(self.ring.group), C.rank(self.ring.group)
        mine, theirs = chunks_of(cp, rank), chunks_of(cp, src)
        return [(i, j, kc == qc, self._drop(qc, kc)) for i, qc in enumerate(mine) for j, kc in enumerate(theirs)
                if kc <= qc]

    def _drop(self, q_chunk: int, k_chunk: int) -> Optional[blocks.Drop]:
        return blocks.Drop(self.p, derive_seed(self.seed, q_chunk, k_chunk)) if self.p > 0 else None


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return t.chunk(2, dim=2)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: _Spec) -> blocks.Partial:
    """(output, log-sum-exp) of this rank's queries over the whole sequence, fp32."""
    ring = spec.ring
    cp, rank = C.size(ring.group), C.rank(ring.group)
    acc: list[Optional[blocks.Partial]] = [None, None]
    kv, qs = (k, v), _halves(q)
    for step in range(cp):
        hop = ring.start(list(kv)) if step < cp - 1 else None
        ks, vs = _halves(kv[0]), _halves(kv[1])
        for i, j, causal, drop in spec.pairs((rank - step) % cp):
            acc[i] = blocks.merge(acc[i], blocks.forward(qs[i], ks[j], vs[j], causal, spec.scale, drop))
        kv = tuple(hop.wait()) if hop else kv
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)  # type: ignore[index]


@dataclass
class _Queries:
    """This rank's two query chunks with what their backward needs, each a pair by chunk slot (`_halves`)."""

    q: tuple[torch.Tensor, ...]
    dout: tuple[torch.Tensor, ...]  # fp32
    out: tuple[torch.Tensor, ...]  # fp32, the final output
    lse: tuple[torch.Tensor, ...]  # the final log-sum-exp
    dq: tuple[torch.Tensor, ...]  # fp32, accumulated here
    scale: float

    def backward(self, pairs: list[Pair], kv: tuple[torch.Tensor, ...], dkv: tuple[torch.Tensor, torch.Tensor]
                 ) -> None:
        """Add the gradients of the block pairs `pairs` against K/V `kv` to dq and to `dkv` (dK, dV)."""
        ks, vs, dks, dvs = _halves(kv[0]), _halves(kv[1]), _halves(dkv[0]), _halves(dkv[1])
        for i, j, causal, drop in pairs:
            grads = blocks.backward(self.dout[i], self.out[i], self.q[i], ks[j], vs[j], self.lse[i], causal,
                                    self.scale, drop)
            for total, part in zip((self.dq[i], dks[j], dvs[j]), grads):
                total.add_(part)


def _backward(dout: torch.Tensor, saved: tuple[torch.Tensor, ...], spec: _Spec
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) fp32 of this rank's chunks. The rank's own block is split around the ring: its full pair
    is attended while the first K/V hop travels, its two causal pairs while the last dK/dV hop does."""
    q, k, v, out, lse = saved
    cp, rank = C.size(spec.ring.group), C.rank(spec.ring.group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    local = _Queries(_halves(q), _halves(dout), _halves(out), _halves(lse), _halves(dq), spec.scale)
    own = spec.pairs(rank)
    mine = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
    hop = spec.ring.start([k, v]) if cp > 1 else None
    local.backward([p for p in own if not p[2]], (k, v), mine)
    arriving = _around(local, spec, hop)
    local.backward([p for p in own if p[2]], (k, v), mine)
    for total, part in zip(mine, arriving.wait() if arriving is not None else ()):
        total.add_(part)
    return dq, mine[0], mine[1]


def _around(local: _Queries, spec: _Spec, hop: Optional[Hop]) -> Optional[Hop]:
    """Steps 1 … cp−1: each block from the previous rank attended, its dK/dV share added to the previous rank's
    and sent on; the hop bringing this rank's own block's gradient, summed over the other ranks (None at cp 1)."""
    ring = spec.ring
    cp, rank = C.size(ring.group), C.rank(ring.group)
    grads: Optional[Hop] = None
    for step in range(1, cp):
        kv = tuple(hop.wait())  # type: ignore[union-attr]
        hop = ring.start(list(kv)) if step < cp - 1 else None
        dkv = (torch.zeros_like(kv[0], dtype=torch.float32), torch.zeros_like(kv[1], dtype=torch.float32))
        local.backward(spec.pairs((rank - step) % cp), kv, dkv)
        grads = _pass_on(ring, grads, *dkv)
    return grads


def _pass_on(ring: Ring, arriving: Optional[Hop], dk: torch.Tensor, dv: torch.Tensor) -> Hop:
    """Add the block's dK/dV from the previous rank to this rank's share and send the sum to the next."""
    for total, before in zip((dk, dv), arriving.wait() if arriving is not None else ()):
        total.add_(before)
    return ring.start([dk, dv])


class _RingAttention(torch.autograd.Function):
    """q [b, h, s/cp, d], k and v [b, hk, s/cp, d] (this rank's two chunks) → causal attention output, q's dtype."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: _Spec) -> torch.Tensor:  # noqa: ANN001
        ctx.spec = spec
        out, lse = _forward(q, k, v, spec)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] in memory, as SDPA's: the output
        ctx.save_for_backward(q, k, v, out, lse)  # projection's [b, s, h·d] input is then a view, not a copy
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = _backward(grad.float(), ctx.saved_tensors, ctx.spec)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, dropout_p: float = 0.0,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (load-balanced layout, `sharding`):
    equal to `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on the whole sequence, sharded.
    With `dropout_p` > 0 the masks' seed is one draw from the default generator of q's device (the caller's
    stream: the TP rank's, forked), each block's mask then seeded by its chunks' places (`blocks.Drop`)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens (two chunks), got {q.shape[2]}")
    seed = int(torch.randint(0, 2**62, (1,), device=q.device).item()) if dropout_p > 0 else 0
    spec = _Spec(Ring(group), scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), dropout_p, seed)
    return _RingAttention.apply(q, k, v, spec)
