"""Tensor-parallel layers and a whole `Block` on gloo ranks, each against a reference.

References:
- the unsharded torch layer (`nn.Linear`, `F.embedding`, `F.cross_entropy`) built from the same full
  weight: every TP rank's output, input gradient and parameter gradient of `ColumnParallelLinear`,
  `RowParallelLinear`, `VocabParallelEmbedding` and `vocab_parallel_cross_entropy` must equal the matching
  slice (`Shard.slice` of the full tensor, `split_seq` / `split_last` of activations) of the reference;
- for a whole `Block`, the same block built at tp=1 from the same seed (`init_parameters` is
  layout-independent);
- traffic: `collectives.COUNTER` against the documented byte formula (bytes = the whole tensor the
  collective works on, elements × itemsize, computed here from the tensors' shapes).

Tolerances: everything runs in fp64 (layers built, then `.double()`), so outputs and gradients differ
from the references only by summation order: rtol = 1e-10, atol = 1e-12 (measured: max abs error
8e-14 on the Block, ≤ 7e-15 for single layers; ~1e-15 relative).
`vocab_parallel_cross_entropy` casts logits to fp32 (`logits.float()`, as the tp=1 path does), so its
loss and logits gradient are fp32 numbers compared with an fp64 `F.cross_entropy`: rtol = 1e-5,
atol = 1e-6 (measured max abs error 4e-7 on the loss, ~1e-7 relative). Sequence-parallel gradients
after the sync are compared across ranks exactly.

The checks run in one launch per TP size (2 and 4 ranks, once per session: `launched`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from tp_helpers import (
    EXACT,
    FFN,
    PARTS,
    TIMEOUT,
    TOL,
    VOCAB,
    B,
    H,
    S,
    assert_ranks,
    assert_traffic,
    counted_fwd_bwd,
    detached,
    leaf,
    load_full,
    nbytes,
    randn,
    tp_group,
)

from hybrid.config import ModelConfig
from hybrid.model.family import family_of
from hybrid.model.layers import Block
from hybrid.model.rope import rope_tables
from hybrid.parallel import collectives as C
from hybrid.parallel.dp.grads import sync_sequence_parallel_grads
from hybrid.parallel.params import Shard, init_parameters, param_info
from hybrid.parallel.rng import TPRandom
from hybrid.parallel.tp.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
    vocab_parallel_cross_entropy,
)

CE_TOL = {"rtol": 1e-5, "atol": 1e-6}


# ------------------------------------------------------------------------------------ 1: layers vs torch


def column_case(group: dist.ProcessGroup, parts: tuple[int, ...], sp: bool, gather: bool) -> dict[str, Any]:
    n, r, out = C.size(group), C.rank(group), sum(parts)
    full = {"weight": randn(1, out, H), "bias": randn(2, out)}
    ref = nn.Linear(H, out).double()
    load_full(ref, full)
    layer = ColumnParallelLinear(H, parts, group, gather_output=gather, sequence_parallel=sp).double()
    load_full(layer, full)
    x, g = randn(3, B, S, H), randn(4, B, S, out)
    x_ref = leaf(x)
    y_ref = ref(x_ref)
    y_ref.backward(g)

    by_part = Shard(-1, parts, r, n)  # this rank's output features: the same cut as the weight rows
    x_in = leaf(C.split_seq(x, group) if sp else x)
    y, fwd, bwd = counted_fwd_bwd(lambda: layer(x_in), g if gather else by_part.slice(g))

    pairs = {
        "y": (y, y_ref if gather else by_part.slice(y_ref)),
        "dx": (x_in.grad, C.split_seq(x_ref.grad, group) if sp else x_ref.grad),
        "dweight": (layer.weight.grad, param_info(layer.weight).shard.slice(ref.weight.grad)),
        "dbias": (layer.bias.grad, param_info(layer.bias).shard.slice(ref.bias.grad)),
    }
    whole_x = nbytes(x)  # [b, s, h]: the gathered input, the all-reduced / reduce-scattered input grad
    if sp:
        expect_fwd = {"all_gather": (whole_x, 1)}
        expect_bwd = {"regather": (whole_x, 1), "reduce_scatter": (whole_x, 1)}
    else:
        expect_fwd = {"all_gather": (nbytes(y_ref), 1)} if gather else {}
        expect_bwd = {"all_reduce": (whole_x, 1)}
    return {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd, "expect_fwd": expect_fwd, "expect_bwd": expect_bwd}


def column_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    return {
        "fused": column_case(group, PARTS, sp=False, gather=False),
        "gather_output": column_case(group, (2 * H,), sp=False, gather=True),
        "gather_output_fused": column_case(group, PARTS, sp=False, gather=True),
        "fused_sp": column_case(group, PARTS, sp=True, gather=False),
    }


def row_case(group: dist.ProcessGroup, sp: bool) -> dict[str, Any]:
    full = {"weight": randn(11, H, FFN), "bias": randn(12, H)}
    ref = nn.Linear(FFN, H).double()
    load_full(ref, full)
    layer = RowParallelLinear(FFN, H, group, sequence_parallel=sp).double()
    load_full(layer, full)
    x, g = randn(13, B, S, FFN), randn(14, B, S, H)
    x_ref = leaf(x)
    y_ref = ref(x_ref)
    y_ref.backward(g)

    x_in = leaf(C.split_last(x, group))  # the input arrives split along features (from a column layer)
    y, fwd, bwd = counted_fwd_bwd(lambda: layer(x_in), C.split_seq(g, group) if sp else g)

    pairs = {
        "y": (y, C.split_seq(y_ref, group) if sp else y_ref),
        "dx": (x_in.grad, C.split_last(x_ref.grad, group)),
        "dweight": (layer.weight.grad, param_info(layer.weight).shard.slice(ref.weight.grad)),
    }
    partial = layer.bias.grad.clone()
    sync_sequence_parallel_grads(list(layer.parameters()), group)  # a no-op without SP
    pairs["dbias"] = (layer.bias.grad, ref.bias.grad)
    whole_y = nbytes(y_ref)
    expect_fwd = {"reduce_scatter" if sp else "all_reduce": (whole_y, 1)}
    expect_bwd = {"all_gather": (whole_y, 1)} if sp else {}
    return {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd, "expect_fwd": expect_fwd, "expect_bwd": expect_bwd,
            "bias_partial": partial, "bias_ref": ref.bias.grad.clone(),
            "flags": (param_info(layer.weight).sequence_parallel, param_info(layer.bias).sequence_parallel)}


def row_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    return {"row": row_case(group, sp=False), "row_sp": row_case(group, sp=True)}


def covering_ids(seed: int, world: int, padded: int) -> torch.Tensor:
    """[B, S] ids below VOCAB that include the first id of every rank's row range and the last real id."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    rows = padded // world
    firsts = [q * rows for q in range(world) if q * rows < VOCAB] + [VOCAB - 1]
    ids.view(-1)[: len(firsts)] = torch.tensor(firsts)
    return ids


def embedding_case(group: dist.ProcessGroup, sp: bool) -> dict[str, Any]:
    n = C.size(group)
    padded = padded_vocab(VOCAB, 4, n)
    full = {"weight": randn(21, padded, H)}
    layer = VocabParallelEmbedding(padded, H, group, sequence_parallel=sp).double()
    load_full(layer, full)
    ids, g = covering_ids(22, n, padded), randn(23, B, S, H)
    w_ref = leaf(full["weight"])
    y_ref = F.embedding(ids, w_ref)
    y_ref.backward(g)

    y, fwd, bwd = counted_fwd_bwd(lambda: layer(ids), C.split_seq(g, group) if sp else g)

    pairs = {
        "y": (y, C.split_seq(y_ref, group) if sp else y_ref),
        "dweight": (layer.weight.grad, param_info(layer.weight).shard.slice(w_ref.grad)),
    }
    whole = nbytes(y_ref)
    return {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd,
            "expect_fwd": {"reduce_scatter" if sp else "all_reduce": (whole, 1)},
            "expect_bwd": {"all_gather": (whole, 1)} if sp else {},
            "rows_hit": bool(layer.weight.grad.abs().sum() > 0)}


def embedding_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    return {"embedding": embedding_case(group, sp=False), "embedding_sp": embedding_case(group, sp=True)}


def cross_entropy_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    padded = padded_vocab(VOCAB, 4, world)
    logits = randn(31, B, S, padded)
    logits[..., VOCAB:] = 20.0  # padding that would dominate the softmax if it were not masked
    target = covering_ids(32, world, padded)
    full = leaf(logits)
    ref = F.cross_entropy(full[..., :VOCAB].flatten(0, 1), target.flatten())
    ref.backward()

    local = leaf(C.split_last(logits, group))
    loss, fwd, bwd = counted_fwd_bwd(lambda: vocab_parallel_cross_entropy(local, target, group, VOCAB))
    start = rank * local.shape[-1]
    pad = torch.arange(start, start + local.shape[-1]) >= VOCAB
    fp32 = torch.empty((), dtype=torch.float32).element_size()  # the loss is computed on logits.float()
    pairs = {"loss": (loss.double(), ref), "dlogits": (local.grad, C.split_last(full.grad, group))}
    return {"ce": {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd,
                   "expect_fwd": {"all_reduce": (3 * B * S * fp32, 3)}, "expect_bwd": {},
                   "pad_grad": local.grad[..., pad].abs().max().item() if pad.any() else 0.0}}


def every_check(rank: int, world: int) -> dict[str, Any]:
    """Rank function: every check of this TP size in turn (the whole Block at tp=2) → its result by name."""
    out = {"column": column_checks(rank, world), "row": row_checks(rank, world),
           "embedding": embedding_checks(rank, world), "cross_entropy": cross_entropy_checks(rank, world)}
    if world == 2:
        out.update({f"block-{family}": block_checks(rank, world, family) for family in ("gpt", "llama")})
    return out


@functools.cache
def launched(tp: int) -> dict[str, list[dict[str, Any]]]:
    """check → its results by rank, from the one launch on `tp` ranks."""
    torch.set_num_threads(1)
    results = run_ranks(every_check, tp, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in results[0]}


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear(tp: int) -> None:
    """Fused (q, kv, kv) parts, gather_output, and sequence parallelism (output: the whole sequence)."""
    results = launched(tp)["column"]
    assert_ranks(results)
    assert_traffic(results)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear(tp: int) -> None:
    results = launched(tp)["row"]
    assert_ranks(results)
    assert_traffic(results)
    for r in results:
        assert r["row"]["flags"] == (False, False)
        assert r["row_sp"]["flags"] == (False, True)  # the bias is added to the chunk: a partial gradient
        torch.testing.assert_close(r["row"]["bias_partial"], r["row"]["bias_ref"], **TOL)
    partials = [r["row_sp"]["bias_partial"] for r in results]
    ref = results[0]["row_sp"]["bias_ref"]
    assert not torch.allclose(partials[0], ref)
    torch.testing.assert_close(sum(partials), ref, **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding(tp: int) -> None:
    results = launched(tp)["embedding"]
    assert_ranks(results)
    assert_traffic(results)
    assert all(r[case]["rows_hit"] for r in results for case in r), "every rank's row range must be looked up"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy(tp: int) -> None:
    results = launched(tp)["cross_entropy"]
    assert_ranks(results, CE_TOL)
    assert_traffic(results)
    assert all(r["ce"]["pad_grad"] == 0.0 for r in results)


# ---------------------------------------------------------------------------------------- 2: whole Block


def block_cfg(family: str) -> ModelConfig:
    return ModelConfig(family=family, n_layers=2, hidden=64, n_heads=4, n_kv_heads=2 if family == "llama" else None,
                       ffn_hidden=128, max_seq_len=32, init_std=0.2)


def build_block(cfg: ModelConfig, group: dist.ProcessGroup | None, sp: bool, seed: int) -> Block:
    block = Block(cfg, family_of(cfg).blocks, group, sp, TPRandom(0))
    init_parameters(block, seed)
    return block.double()


def block_checks(rank: int, world: int, family: str) -> dict[str, Any]:
    group = tp_group(world)
    cfg = block_cfg(family)
    rope = None
    if family == "llama":
        cos, sin = rope_tables(cfg.hidden // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        rope = (cos.double(), sin.double())
    x, g = randn(41, B, 16, cfg.hidden), randn(42, B, 16, cfg.hidden)
    ref = build_block(cfg, None, False, seed=5)
    x_ref = leaf(x)
    y_ref = ref(x_ref, rope)
    y_ref.backward(g)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    out: dict[str, Any] = {}
    for sp in (False, True):
        block = build_block(cfg, group, sp, seed=5)
        params = dict(block.named_parameters())
        assert params.keys() == ref_grads.keys()
        chunk = (lambda t: C.split_seq(t, group)) if sp else (lambda t: t)
        x_in = leaf(chunk(x))
        y = block(x_in, rope)
        y.backward(chunk(g))
        pairs = {"y": (y, chunk(y_ref)), "dx": (x_in.grad, chunk(x_ref.grad))}
        sp_names = sorted(n for n, p in params.items() if param_info(p).sequence_parallel)
        partial = {n: params[n].grad.clone() for n in sp_names}
        sync_sequence_parallel_grads(list(params.values()), group)
        for n, p in params.items():
            shard = param_info(p).shard
            pairs["d:" + n] = (p.grad, shard.slice(ref_grads[n]) if shard is not None else ref_grads[n])
        out["sp" if sp else "no_sp"] = {
            "pairs": detached(pairs), "sp_names": sp_names, "partial": partial,
            "synced": {n: params[n].grad.clone() for n in sp_names},
            "sharded": sorted(n for n, p in params.items() if param_info(p).shard is not None),
        }
    out["ref_grads"] = {n: g.clone() for n, g in ref_grads.items()}
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_block_matches_tp1(family: str) -> None:
    results = launched(2)[f"block-{family}"]
    ref_grads = results[0]["ref_grads"]
    assert_ranks([{k: r[k] for k in ("no_sp", "sp")} for r in results])
    for r in results:
        assert r["no_sp"]["sp_names"] == []
        assert {"attn.qkv.weight", "attn.proj.weight", "mlp.up.weight", "mlp.down.weight"} <= set(r["sp"]["sharded"])
    sp_names = results[0]["sp"]["sp_names"]
    expected = {"attn_norm.weight", "mlp_norm.weight"}
    if family == "gpt":  # LayerNorm biases and the row-parallel biases are applied to the sequence chunk too
        expected |= {"attn_norm.bias", "mlp_norm.bias", "attn.proj.bias", "mlp.down.bias"}
    assert set(sp_names) == expected
    for n in sp_names:
        partials = [r["sp"]["partial"][n] for r in results]
        assert not torch.allclose(partials[0], ref_grads[n]), f"{n}: expected a partial (chunk-only) gradient"
        torch.testing.assert_close(sum(partials), ref_grads[n], **TOL)
        for r in results[1:]:  # after the sync: identical on every TP rank
            torch.testing.assert_close(r["sp"]["synced"][n], results[0]["sp"]["synced"][n], **EXACT)

