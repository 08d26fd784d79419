"""Ring and all-to-all (Ulysses) attention on gloo CP ranks against `scaled_dot_product_attention` on the whole
sequence.

At cp 2, 3 (odd) and 4: each rank holds its load-balanced two chunks (`cp.sharding`) of q, k, v; the outputs and
the gradients of q, k and v, put back in sequence order, equal causal SDPA's on the whole sequence (with the
ring's attention dropout: the whole softmax dropped by the ring's masks laid side by side) and autograd's
gradients (fp32, rtol 1e-5 / atol 1e-6: only the summation order differs), with grouped K/V heads (4 query heads
and 2 K/V; 6 and 3) and without. All-to-all runs where the query heads divide by cp; K/V heads that do not are
repeated first (6/3 at cp 2, 4/2 at cp 4). The bytes each rank sends on the cp group equal the formulas: ring,
forward (cp−1) hops of K and V, backward (cp−1) hops of K and V plus cp−1 hops of their fp32 gradients; all-to-all,
one of q, k, v and the output forward and again backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

B, S, D = 2, 24, 8
CASES = ((4, 2), (4, 4), (6, 3))  # (query heads, K/V heads)
KINDS = ("ring", "a2a", "ring_dropout")
P, DROP_SEED = 0.25, 7  # the ring's attention dropout and the default generator's seed it draws its masks' seed from


def full(heads: int, kv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g) for h in (heads, kv, kv, heads))  # q, k, v, dout


def on_rank(rank: int, world: int) -> dict[str, Any]:
    from hybrid.parallel import collectives as C
    from hybrid.parallel.cp.ring import ring_attention
    from hybrid.parallel.cp.sharding import shard
    from hybrid.parallel.cp.ulysses import ulysses_attention

    group = dist.group.WORLD
    C.name_group(group, "cp")
    torch.manual_seed(DROP_SEED)
    attend = {"ring": ring_attention, "a2a": ulysses_attention,
              "ring_dropout": lambda *a: ring_attention(*a, dropout_p=P)}
    out: dict[Any, Any] = {}
    for (heads, kv), kind in ((c, k) for c in CASES for k in KINDS if k != "a2a" or c[0] % world == 0):
        C.COUNTER.reset()
        q, k, v, dout = (shard(t, world, rank, dim=2) for t in full(heads, kv, seed=heads + kv))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = attend[kind](*leaves, group)
        y.backward(dout)
        sent = C.COUNTER.group_bytes("cp")
        out[heads, kv, kind] = {"y": y.detach(), "grads": [t.grad for t in leaves], "bytes": sent}
    return out


def expected_bytes(kind: str, heads: int, kv: int, cp: int) -> int:
    """What one rank sends on the cp group for one attention forward and backward, fp32."""
    per_head = B * (S // cp) * D * 4  # one head's local tokens
    if kind == "ring":
        return (cp - 1) * 2 * kv * per_head * 3  # K/V forward and backward, dK/dV
    if kind == "ring_dropout":
        return expected_bytes("ring", heads, kv, cp)
    sent_kv = kv if kv % cp == 0 else heads
    return 2 * (2 * heads + 2 * sent_kv) * per_head


def dropout_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, draws: int) -> torch.Tensor:
    """Whole-sequence causal attention with the ring's masks laid side by side: block (query chunk a, key chunk
    c ≤ a) dropped by `Drop(P, derive_seed(seed, a, c))`, the seed the `draws`-th from the default generator."""
    from hybrid.parallel.cp import blocks
    from hybrid.parallel.rng import derive_seed

    torch.manual_seed(DROP_SEED)
    seed = [int(torch.randint(0, 2**62, (1,)).item()) for _ in range(draws)][-1]
    n, heads = S // (2 * cp), q.shape[1]
    keep = torch.zeros(B, heads, S, S)
    for a in range(2 * cp):
        for c in range(a + 1):
            keep[:, :, a * n:(a + 1) * n, c * n:(c + 1) * n] = blocks.Drop(P, derive_seed(seed, a, c)).keep(
                slice(0, n), torch.Size((B, heads, n, n)), q.device)
    s = q @ k.repeat_interleave(heads // k.shape[1], 1).transpose(-1, -2) * D ** -0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) * keep) @ v.repeat_interleave(heads // v.shape[1], 1)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_context_parallel_attention_equals_whole_sequence_sdpa(cp: int) -> None:
    """Also with dropout on the ring: against the whole softmax dropped by the ring's masks, side by side."""
    from hybrid.parallel.cp.sharding import unshard

    ranks = run_ranks(on_rank, cp, timeout=120)
    assert len(ranks[0]) == 2 * len(CASES) + sum(h % cp == 0 for h, _ in CASES)
    for heads, kv, kind in ranks[0]:
        q, k, v, dout = (t.requires_grad_() for t in full(heads, kv, seed=heads + kv))
        if kind == "ring_dropout":
            ref = dropout_reference(q, k, v, cp, draws=1 + list(CASES).index((heads, kv)))
        else:
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref.backward(dout)
        got = [r[heads, kv, kind] for r in ranks]
        tol = {"rtol": 1e-5, "atol": 1e-6, "msg": lambda m, c=(heads, kv, kind): f"{c}: {m}"}
        torch.testing.assert_close(unshard([g["y"] for g in got], dim=2), ref.detach(), **tol)
        for i, want in enumerate((q.grad, k.grad, v.grad)):
            torch.testing.assert_close(unshard([g["grads"][i] for g in got], dim=2), want, **tol)
        want = expected_bytes(kind, heads, kv, cp)
        assert all(g["bytes"] == want for g in got), (heads, kv, kind, want, [g["bytes"] for g in got])
