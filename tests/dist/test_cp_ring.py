"""Ring attention on gloo CP ranks against `scaled_dot_product_attention` on the whole sequence.

At cp 2, 3 (odd) and 4: each rank holds its load-balanced two chunks (`cp.sharding`) of q, k, v; the ring's
outputs and the gradients of q, k and v, put back in sequence order, equal causal SDPA's on the whole sequence
and autograd's gradients (fp32, rtol 1e-5 / atol 1e-6: only the summation order differs), with grouped K/V
heads (4 query heads, 2 K/V) and without. The bytes each rank sends on the cp group equal the formula:
forward (cp−1) hops of K and V, backward (cp−1) hops of K and V plus cp hops of their fp32 gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

B, S, D = 2, 24, 8
CASES = ((4, 2), (4, 4))  # (query heads, K/V heads)


def full(heads: int, kv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g) for h in (heads, kv, kv, heads))  # q, k, v, dout


def on_rank(rank: int, world: int) -> dict[str, Any]:
    from hybrid.parallel import collectives as C
    from hybrid.parallel.cp.ring import ring_attention
    from hybrid.parallel.cp.sharding import shard

    group = dist.group.WORLD
    C.name_group(group, "cp")
    out: dict[str, Any] = {}
    for heads, kv in CASES:
        C.COUNTER.reset()
        q, k, v, dout = (shard(t, world, rank, dim=2) for t in full(heads, kv, seed=heads + kv))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = ring_attention(*leaves, group)
        y.backward(dout)
        out[(heads, kv)] = {"y": y.detach(), "grads": [t.grad for t in leaves], "bytes": C.COUNTER.group_bytes("cp")}
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_equals_whole_sequence_sdpa(cp: int) -> None:
    from hybrid.parallel.cp.sharding import unshard

    ranks = run_ranks(on_rank, cp, timeout=120)
    for heads, kv in CASES:
        q, k, v, dout = (t.requires_grad_() for t in full(heads, kv, seed=heads + kv))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref.backward(dout)
        got = [r[(heads, kv)] for r in ranks]
        tol = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(unshard([g["y"] for g in got], dim=2), ref.detach(), **tol)
        for i, want in enumerate((q.grad, k.grad, v.grad)):
            torch.testing.assert_close(unshard([g["grads"][i] for g in got], dim=2), want, **tol)
        kv_bytes = 2 * B * kv * (S // cp) * D * 4  # K and V, this rank's chunks, fp32
        assert all(g["bytes"] == (cp - 1) * kv_bytes * 2 + cp * kv_bytes for g in got), [g["bytes"] for g in got]
