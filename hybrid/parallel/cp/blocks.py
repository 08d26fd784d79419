"""Attention on one pair of sequence blocks, with what a ring needs to merge and differentiate it.

A query block [b, h, sq, d] against a key/value block [b, hk, sk, d] (hk divides h: grouped-query attention,
each K/V head serving h/hk consecutive query heads, as `scaled_dot_product_attention(enable_gqa=True)`), in
fp32: `forward` returns the block's output and each query's log-sum-exp of scores; `merge` combines two
partial results over different keys by their log-sum-exps (exactly: the softmax over the union); `backward`
recomputes the block's probabilities from the *final* output and log-sum-exp, so each block's gradients are
its share of the whole softmax's. `causal`: the blocks are the same chunk of the sequence (query i sees keys
≤ i); a key block wholly before the queries is attended in full, one wholly after is never passed here.

Dropout on the probabilities (`Drop`) is exact under the merge: the log-sum-exps are the undropped scores',
and each block's kept probabilities are scaled by 1/(1−p) as the whole softmax's would be. A block's mask comes
from a generator seeded per (block, query tile), so its backward draws the same mask again and nothing is kept.

Two kernels: on CPU without dropout torch's fused flash-attention op, which returns the log-sum-exp
(`aten._scaled_dot_product_flash_attention_for_cpu`, SDPA's own CPU kernel, and its backward; it has no
dropout); otherwise fp32 matmuls with an explicit softmax, `TILE` query rows at a time (correct anywhere;
CUDA's fused ops are not wired here yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.parallel.rng import derive_seed

Partial = tuple[torch.Tensor, torch.Tensor]  # (output [b, h, sq, d], log-sum-exp [b, h, sq]), fp32
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (dq, dk, dv), fp32

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class Drop:
    """Dropout at rate `p` on one block's probabilities, its mask drawn per query tile from `seed`."""

    p: float
    seed: int

    def keep(self, rows: slice, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The tile `rows`' scale per probability, fp32 `shape`: 1/(1−p) where kept, 0 where dropped."""
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed(self.seed, rows.start))
        kept = torch.rand(shape, generator=g, device=device) >= self.p
        return kept.float() / (1.0 - self.p)


def fused(device: torch.device) -> bool:
    """Whether blocks on `device` run through torch's fused kernel (else the tiled fp32 math)."""
    return device.type == "cpu"


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            drop: Optional[Drop] = None) -> Partial:
    """softmax(q kᵀ·scale [+ causal mask]) v over this key block (its probabilities dropped by `drop`), and the
    scores' log-sum-exp per query."""
    if drop is None and fused(q.device):
        return _CPU_FLASH(q.float(), k.float(), v.float(), 0.0, causal, scale=scale)
    parts = [_forward_rows(q[:, :, rows], k, v, causal, scale, rows, drop) for rows in _tiles(q.shape[2])]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)


def backward(dout: torch.Tensor, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lse: torch.Tensor, causal: bool, scale: float, drop: Optional[Drop] = None) -> Grads:
    """(dq, dk, dv) of this block pair, fp32, given the gradient `dout` (fp32) of the queries' final output
    `out` (fp32, over the whole sequence) and its final log-sum-exp `lse`; `drop` as in its forward."""
    if drop is None and fused(q.device):
        grads = _CPU_FLASH_BACKWARD(dout, q.float(), k.float(), v.float(), out, lse, 0.0, causal, scale=scale)
        return grads  # type: ignore[no-any-return]
    return _math_backward(dout, (dout * out).sum(dim=-1), q, k, v, lse, causal, scale, drop)


def merge(acc: Optional[Partial], new: Partial) -> Partial:
    """Two partial attentions of the same queries over disjoint keys → the attention over both keys."""
    if acc is None:
        return new
    lse = torch.logaddexp(acc[1], new[1])
    return (acc[0] * torch.exp(acc[1] - lse).unsqueeze(-1) + new[0] * torch.exp(new[1] - lse).unsqueeze(-1), lse)


TILE = 1024  # the math kernel's query rows at a time: its fp32 scores never exceed [b, h, TILE, keys]


def _tiles(n: int) -> list[slice]:
    return [slice(lo, min(lo + TILE, n)) for lo in range(0, n, TILE)]


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with each of its heads repeated for the query heads it serves."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head summed into the K/V head that served it."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, first: int = 0) -> torch.Tensor:
    """Query rows `first`… of the block against its keys; causal: key j is seen by query row i if j ≤ i."""
    s = q.float() @ _expand(k, q.shape[1]).float().transpose(-1, -2) * scale
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first)
        s = s.masked_fill(future, float("-inf"))
    return s


def _forward_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  rows: slice, drop: Optional[Drop]) -> Partial:
    s = _scores(q, k, causal, scale, rows.start)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = p * drop.keep(rows, p.shape, p.device) if drop is not None else p
    return p @ _expand(v, q.shape[1]).float(), lse


def _math_backward(dout: torch.Tensor, delta: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float, drop: Optional[Drop]) -> Grads:
    """The math kernel's gradients; `delta` = Σ dout·out per query (dropout leaves it so); `TILE` query rows at
    a time, each tile's dropout mask drawn again from its seed."""
    heads = q.shape[1]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros((*q.shape[:2], k.shape[2], k.shape[3]), dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for rows in _tiles(q.shape[2]):
        p = torch.exp(_scores(q[:, :, rows], k, causal, scale, rows.start) - lse[:, :, rows].unsqueeze(-1))
        keep = drop.keep(rows, p.shape, p.device) if drop is not None else 1.0
        dv += (p * keep).transpose(-1, -2) @ dout[:, :, rows]
        dp = dout[:, :, rows] @ _expand(v, heads).float().transpose(-1, -2) * keep
        ds = p * (dp - delta[:, :, rows].unsqueeze(-1))
        dq[:, :, rows] = ds @ _expand(k, heads).float() * scale
        dk += ds.transpose(-1, -2) @ q[:, :, rows].float() * scale
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])
