"""Context parallelism's pieces in one process: the load-balanced layout and block attention.

- `sharding`: shard/unshard round trip at cp 1-4 (each rank two chunks, i and 2·cp−1−i), true positions.
- `blocks`: a causal sequence cut into key blocks (full blocks before, the causal diagonal), merged by
  log-sum-exp, equals `scaled_dot_product_attention(is_causal=True)` on the whole sequence, with grouped K/V
  heads; each block's backward from the final output and log-sum-exp sums to autograd's gradients (fp32, 1e-5);
  both kernels: torch's fused CPU op, and the math one with its query rows whole and in tiles of 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel.cp import blocks, sharding


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_rank_holds_chunks_i_and_its_mirror_and_unshard_inverts_shard(cp: int) -> None:
    t = torch.arange(2 * 24).view(2, 24)
    pieces = [sharding.shard(t, cp, r) for r in range(cp)]
    assert torch.equal(sharding.unshard(pieces), t)
    size = 24 // (2 * cp)
    for r, piece in enumerate(pieces):
        a, b = sharding.chunks_of(cp, r)
        assert torch.equal(piece[0], torch.cat([t[0, a * size:(a + 1) * size], t[0, b * size:(b + 1) * size]]))
        assert torch.equal(sharding.positions(24, cp, r), piece[0])


def _qkv(s: int, heads: int = 4, kv: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, s, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv, s, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv, s, 8, generator=g, requires_grad=True)
    return q, k, v


KERNELS = [("fused", 1024), ("math", 1024), ("math", 3)]


def _kernel(monkeypatch: pytest.MonkeyPatch, kernel: str, tile: int) -> None:
    monkeypatch.setattr(blocks, "TILE", tile)
    if kernel == "math":
        monkeypatch.setattr(blocks, "fused", lambda device: False)


@pytest.mark.parametrize("kernel,tile", KERNELS)
def test_key_blocks_merged_by_log_sum_exp_equal_whole_causal_attention(kernel: str, tile: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries of the last of 3 chunks against chunks 0, 1 (full) and 2 (causal), merged in any order; the query
    rows whole or 3 at a time (`blocks.TILE`: the causal mask follows each tile's first row)."""
    _kernel(monkeypatch, kernel, tile)
    q, k, v = _qkv(12)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, 8:]
    scale = 8 ** -0.5
    parts = [blocks.forward(q[:, :, 8:], k[:, :, c:c + 4], v[:, :, c:c + 4], c == 8, scale) for c in (0, 4, 8)]
    for order in ([0, 1, 2], [2, 0, 1]):
        acc = None
        for i in order:
            acc = blocks.merge(acc, parts[i])
        torch.testing.assert_close(acc[0], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel,tile", KERNELS)
def test_each_blocks_backward_from_the_final_lse_sums_to_autograds(kernel: str, tile: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel(monkeypatch, kernel, tile)
    q, k, v = _qkv(8)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    scale, qq, kk, vv = 8 ** -0.5, q.detach(), k.detach(), v.detach()
    pairs = [(0, 0, True), (1, 0, False), (1, 1, True)]  # (query chunk, key chunk, causal) of 2 chunks of 4
    chunk = lambda t, c: t[:, :, 4 * c:4 * c + 4]  # noqa: E731
    partials = {qc: None for qc in (0, 1)}
    for qc, kc, causal in pairs:
        partials[qc] = blocks.merge(partials[qc], blocks.forward(chunk(qq, qc), chunk(kk, kc), chunk(vv, kc),
                                                                causal, scale))
    dq, dk, dv = torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)
    for qc, kc, causal in pairs:
        o, lse = partials[qc]
        g = blocks.backward(chunk(dout, qc), o, chunk(qq, qc), chunk(kk, kc), chunk(vv, kc), lse, causal, scale)
        chunk(dq, qc).add_(g[0]), chunk(dk, kc).add_(g[1]), chunk(dv, kc).add_(g[2])
    for ours, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def _keep(drop: blocks.Drop, q_rows: int, like: torch.Tensor, keys: int) -> torch.Tensor:
    """A block's whole dropout scale [b, h, q_rows, keys], tile by tile as the math kernel draws it."""
    return torch.cat([drop.keep(rows, torch.Size((*like.shape[:2], rows.stop - rows.start, keys)), like.device)
                      for rows in blocks._tiles(q_rows)], dim=2)


@pytest.mark.parametrize("tile", [1024, 3])
def test_dropout_blocks_equal_the_whole_softmax_with_their_masks(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries of the last of 3 chunks against chunks 0, 1, 2, each block's probabilities dropped (p = 0.3) by its
    own seeded mask: merged, and differentiated block by block, they equal the whole sequence's softmax with the
    three masks side by side, `(softmax(s) ∘ keep) v`, and autograd's gradients of it."""
    monkeypatch.setattr(blocks, "TILE", tile)
    q, k, v = _qkv(12)
    scale, rows = 8 ** -0.5, slice(8, 12)
    drops = [blocks.Drop(0.3, seed) for seed in (11, 12, 13)]
    keep = torch.cat([_keep(d, 4, q, 4) for d in drops], dim=-1)
    assert 0 < (keep == 0).float().mean() < 1
    s = q[:, :, rows] @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(4, 12, dtype=torch.bool).triu(9), float("-inf"))
    ref = (torch.softmax(s, dim=-1) * keep) @ v.repeat_interleave(2, 1)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    qq, kk, vv = q.detach()[:, :, rows], k.detach(), v.detach()
    acc = None
    for c, drop in zip((0, 4, 8), drops):
        acc = blocks.merge(acc, blocks.forward(qq, kk[:, :, c:c + 4], vv[:, :, c:c + 4], c == 8, scale, drop))
    torch.testing.assert_close(acc[0], ref, rtol=1e-5, atol=1e-6)
    grads = [blocks.backward(dout, acc[0], qq, kk[:, :, c:c + 4], vv[:, :, c:c + 4], acc[1], c == 8, scale, drop)
             for c, drop in zip((0, 4, 8), drops)]
    torch.testing.assert_close(sum(g[0] for g in grads), q.grad[:, :, rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([g[1] for g in grads], dim=2), k.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([g[2] for g in grads], dim=2), v.grad, rtol=1e-5, atol=1e-6)
