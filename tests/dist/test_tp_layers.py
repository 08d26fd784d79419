"""Tensor-parallel layers, region ops, SP gradient sync and the TP RNG on gloo ranks, each against a reference.

References:
- the unsharded torch layer (`nn.Linear`, `F.embedding`, `F.cross_entropy`) built from the same full
  weight: every TP rank's output, input gradient and parameter gradient must equal the matching slice
  (`Shard.slice` of the full tensor, `split_seq` / `split_last` of activations) of the reference;
- for the region ops, the math their docstrings state (sum / concatenation / chunk over every rank's
  input), evaluated on each rank from every rank's (rank-seeded, hence reproducible) tensors;
- for a whole `Block`, the same block built at tp=1 from the same seed (`init_parameters` is
  layout-independent);
- PyTorch's DTensor tensor parallelism (`parallelize_module` with `ColwiseParallel` / `RowwiseParallel`,
  and `SequenceParallel` with `Shard(1)` layouts) on a CPU gloo `DeviceMesh`: a LayerNorm → up → GELU →
  down MLP, with and without sequence parallelism. Both plans run on CPU/gloo in torch 2.13.
- traffic: `collectives.COUNTER` against the documented byte formula (bytes = the whole tensor the
  collective works on, elements × itemsize, computed here from the tensors' shapes).

Tolerances: everything runs in fp64 (layers built, then `.double()`), so outputs and gradients differ
from the references only by summation order: rtol = 1e-10, atol = 1e-12 (measured: max abs error
8e-14 on the Block, 7e-14 vs DTensor, ≤ 7e-15 for single layers; ~1e-15 relative).
`vocab_parallel_cross_entropy` casts logits to fp32 (`logits.float()`, as the tp=1 path does), so its
loss and logits gradient are fp32 numbers compared with an fp64 `F.cross_entropy`: rtol = 1e-5,
atol = 1e-6 (measured max abs error 4e-7 on the loss, ~1e-7 relative). Pure data movement
(`full_tensor`, synced gradients across ranks, RNG draws) is compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh  # imported before the ranks fork: once, not per rank
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from hybrid.config import ModelConfig
from hybrid.model.layers import Block, CausalLM, Norm, rope_tables
from hybrid.parallel import collectives as C
from hybrid.parallel.rng import TPRandom
from hybrid.parallel.tensor import (
    ColumnParallelLinear,
    Init,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    annotate,
    full_state_dict,
    full_tensor,
    init_parameters,
    padded_vocab,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)

B, S, H, FFN = 2, 8, 16, 32  # S, H and FFN divide by tp = 4
PARTS = (16, 8, 8)  # a fused Q | K | V projection with fewer KV features (GQA), each part split on its own
VOCAB = 51  # not a multiple of tp: padded to 56 (tp=2) / 64 (tp=4); rank 3 of 4 holds ids 48..50 + padding
TOL = {"rtol": 1e-10, "atol": 1e-12}
CE_TOL = {"rtol": 1e-5, "atol": 1e-6}
EXACT = {"rtol": 0.0, "atol": 0.0}
TIMEOUT = 120

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
Traffic = dict[str, tuple[int, int]]  # op → (bytes, calls) on the group named "tp"


# ----------------------------------------------------------------------------------------------- helpers


def randn(seed: int, *shape: int) -> torch.Tensor:
    """fp64 normal tensor from a private generator: identical on every rank for the same seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def tp_group(world: int) -> dist.ProcessGroup:
    group = dist.new_group(list(range(world)))
    C.name_group(group, "tp")
    return group


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def traffic() -> Traffic:
    """What COUNTER recorded on the "tp" group since the last reset."""
    return {op: (b, C.COUNTER.calls[(g, op)]) for (g, op), b in C.COUNTER.bytes.items() if g == "tp" and b}


@torch.no_grad()
def load_full(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy each full (global) tensor into the parameter of that name: this rank's slice if sharded."""
    for name, p in module.named_parameters():
        shard = getattr(p, "hybrid_shard", None)  # plain torch parameters: the full tensor
        p.copy_(shard.slice(full[name]) if shard is not None else full[name])


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def detached(pairs: Pairs) -> Pairs:
    return {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in pairs.items()}


def assert_pairs(pairs: Pairs, where: str, tol: dict[str, float]) -> None:
    for name, (ours, ref) in pairs.items():
        assert ours.shape == ref.shape, f"{where} {name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
        torch.testing.assert_close(ours, ref, **tol, msg=lambda m, n=name: f"{where} {n}: {m}")


def assert_ranks(results: list[dict[str, Any]], tol: dict[str, float] = TOL) -> None:
    """Every rank's `pairs` (for each case) match."""
    for rank, cases in enumerate(results):
        for case, r in cases.items():
            assert_pairs(r["pairs"], f"rank {rank} {case}", tol)


def assert_traffic(results: list[dict[str, Any]]) -> None:
    for rank, cases in enumerate(results):
        for case, r in cases.items():
            for phase in ("fwd", "bwd"):
                assert r[phase] == r["expect_" + phase], f"rank {rank} {case} {phase}: {r[phase]}"


# ------------------------------------------------------------------------------- 1, 2: layers vs torch


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
    C.COUNTER.reset()
    y = layer(x_in)
    fwd = traffic()
    C.COUNTER.reset()
    y.backward(g if gather else by_part.slice(g))
    bwd = traffic()

    pairs = {
        "y": (y, y_ref if gather else by_part.slice(y_ref)),
        "dx": (x_in.grad, C.split_seq(x_ref.grad, group) if sp else x_ref.grad),
        "dweight": (layer.weight.grad, layer.weight.hybrid_shard.slice(ref.weight.grad)),
        "dbias": (layer.bias.grad, layer.bias.hybrid_shard.slice(ref.bias.grad)),
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
    C.COUNTER.reset()
    y = layer(x_in)
    fwd = traffic()
    C.COUNTER.reset()
    y.backward(C.split_seq(g, group) if sp else g)
    bwd = traffic()

    pairs = {
        "y": (y, C.split_seq(y_ref, group) if sp else y_ref),
        "dx": (x_in.grad, C.split_last(x_ref.grad, group)),
        "dweight": (layer.weight.grad, layer.weight.hybrid_shard.slice(ref.weight.grad)),
    }
    partial = layer.bias.grad.clone()
    sync_sequence_parallel_grads(list(layer.parameters()), group)  # a no-op without SP
    pairs["dbias"] = (layer.bias.grad, ref.bias.grad)
    whole_y = nbytes(y_ref)
    expect_fwd = {"reduce_scatter" if sp else "all_reduce": (whole_y, 1)}
    expect_bwd = {"all_gather": (whole_y, 1)} if sp else {}
    return {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd, "expect_fwd": expect_fwd, "expect_bwd": expect_bwd,
            "bias_partial": partial, "bias_ref": ref.bias.grad.clone(),
            "flags": (layer.weight.sequence_parallel, layer.bias.sequence_parallel)}


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

    C.COUNTER.reset()
    y = layer(ids)
    fwd = traffic()
    C.COUNTER.reset()
    y.backward(C.split_seq(g, group) if sp else g)
    bwd = traffic()

    pairs = {
        "y": (y, C.split_seq(y_ref, group) if sp else y_ref),
        "dweight": (layer.weight.grad, layer.weight.hybrid_shard.slice(w_ref.grad)),
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
    C.COUNTER.reset()
    loss = vocab_parallel_cross_entropy(local, target, group, VOCAB)
    fwd = traffic()
    C.COUNTER.reset()
    loss.backward()
    bwd = traffic()
    start = rank * local.shape[-1]
    pad = torch.arange(start, start + local.shape[-1]) >= VOCAB
    fp32 = torch.empty((), dtype=torch.float32).element_size()  # the loss is computed on logits.float()
    pairs = {"loss": (loss.double(), ref), "dlogits": (local.grad, C.split_last(full.grad, group))}
    return {"ce": {"pairs": detached(pairs), "fwd": fwd, "bwd": bwd,
                   "expect_fwd": {"all_reduce": (3 * B * S * fp32, 3)}, "expect_bwd": {},
                   "pad_grad": local.grad[..., pad].abs().max().item() if pad.any() else 0.0}}


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear(tp: int) -> None:
    """Fused (q, kv, kv) parts, gather_output, and sequence parallelism (output: the whole sequence)."""
    results = run_ranks(column_checks, tp, timeout=TIMEOUT)
    assert_ranks(results)
    assert_traffic(results)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear(tp: int) -> None:
    results = run_ranks(row_checks, tp, timeout=TIMEOUT)
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
    results = run_ranks(embedding_checks, tp, timeout=TIMEOUT)
    assert_ranks(results)
    assert_traffic(results)
    assert all(r[case]["rows_hit"] for r in results for case in r), "every rank's row range must be looked up"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy(tp: int) -> None:
    results = run_ranks(cross_entropy_checks, tp, timeout=TIMEOUT)
    assert_ranks(results, CE_TOL)
    assert_traffic(results)
    assert all(r["ce"]["pad_grad"] == 0.0 for r in results)


# ------------------------------------------------------------------------------------ 3: region ops


def _sum(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts).sum(0)


# name → (op, input shape, output shape, forward math, backward math, expected fwd / bwd traffic), for n ranks.
# Forward math maps (every rank's input, rank) to this rank's output; backward math maps every rank's
# output gradient to this rank's input gradient. Traffic: (op, which tensor's bytes: "in" or "out").
RegionSpec = tuple[Callable, Callable[[int], tuple[int, ...]], Callable[[int], tuple[int, ...]],
                   Callable[[list[torch.Tensor], int, int], torch.Tensor],
                   Callable[[list[torch.Tensor], int, int], torch.Tensor],
                   dict[str, str], dict[str, str]]
W = 8  # last dim of the region-op tensors (divides by 4)
REGION_OPS: dict[str, RegionSpec] = {
    "copy_to_region": (C.copy_to_region, lambda n: (B, S, W), lambda n: (B, S, W),
                       lambda xs, r, n: xs[r], lambda gs, r, n: _sum(gs), {}, {"all_reduce": "out"}),
    "reduce_from_region": (C.reduce_from_region, lambda n: (B, S, W), lambda n: (B, S, W),
                           lambda xs, r, n: _sum(xs), lambda gs, r, n: gs[r], {"all_reduce": "out"}, {}),
    "gather_from_region": (C.gather_from_region, lambda n: (B, S, W // n), lambda n: (B, S, W),
                           lambda xs, r, n: torch.cat(xs, -1), lambda gs, r, n: gs[r].chunk(n, -1)[r],
                           {"all_gather": "out"}, {}),
    "split_to_region": (C.split_to_region, lambda n: (B, S, W), lambda n: (B, S, W // n),
                        lambda xs, r, n: xs[r].chunk(n, -1)[r], lambda gs, r, n: torch.cat(gs, -1),
                        {}, {"all_gather": "in"}),
    "gather_from_sequence": (C.gather_from_sequence, lambda n: (B, S // n, W), lambda n: (B, S, W),
                             lambda xs, r, n: torch.cat(xs, 1), lambda gs, r, n: _sum(gs).chunk(n, 1)[r],
                             {"all_gather": "out"}, {"reduce_scatter": "out"}),
    "reduce_scatter_to_sequence": (C.reduce_scatter_to_sequence, lambda n: (B, S, W), lambda n: (B, S // n, W),
                                   lambda xs, r, n: _sum(xs).chunk(n, 1)[r], lambda gs, r, n: torch.cat(gs, 1),
                                   {"reduce_scatter": "in"}, {"all_gather": "in"}),
}


def region_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    out: dict[str, Any] = {}
    for i, (name, (op, in_shape, out_shape, fwd_math, bwd_math, fwd_ops, bwd_ops)) in enumerate(REGION_OPS.items()):
        xs = [randn(100 * i + q, *in_shape(world)) for q in range(world)]  # every rank's input, on every rank
        gs = [randn(100 * i + 50 + q, *out_shape(world)) for q in range(world)]
        x = leaf(xs[rank])
        C.COUNTER.reset()
        y = op(x, group)
        fwd = traffic()
        C.COUNTER.reset()
        y.backward(gs[rank])
        bwd = traffic()
        size = {"in": nbytes(xs[0]), "out": nbytes(gs[0])}
        pairs = {"y": (y, fwd_math(xs, rank, world)), "dx": (x.grad, bwd_math(gs, rank, world))}
        out[name] = {"pairs": detached(pairs),
                     "fwd": fwd, "bwd": bwd,
                     "expect_fwd": {k: (size[v], 1) for k, v in fwd_ops.items()},
                     "expect_bwd": {k: (size[v], 1) for k, v in bwd_ops.items()}}
    t = randn(7, B, S, W)
    C.COUNTER.reset()
    C.all_reduce(t.clone(), group)
    all_reduce_wire = C.COUNTER.wire_bytes("tp")
    C.COUNTER.reset()
    C.gather_from_sequence(C.split_seq(t, group), group)  # all-gathers a tensor of t's size
    C.reduce_scatter_to_sequence(t, group)  # reduce-scatters t
    pair_wire = C.COUNTER.wire_bytes("tp")
    return {"ops": out, "wire": (all_reduce_wire, pair_wire, nbytes(t))}


@pytest.mark.parametrize("tp", [2, 4])
def test_region_ops(tp: int) -> None:
    results = run_ranks(region_checks, tp, timeout=TIMEOUT)
    ops = [r["ops"] for r in results]
    assert_ranks(ops)
    assert_traffic(ops)
    for r in results:
        all_reduce_wire, pair_wire, payload = r["wire"]
        assert all_reduce_wire == pytest.approx(2 * (tp - 1) / tp * payload)
        assert pair_wire == pytest.approx(all_reduce_wire)


# ------------------------------------------------------------------------------------- 4: whole Block


def block_cfg(family: str) -> ModelConfig:
    return ModelConfig(family=family, n_layers=2, hidden=64, n_heads=4, n_kv_heads=2 if family == "llama" else None,
                       ffn_hidden=128, max_seq_len=32, init_std=0.2)


def build_block(cfg: ModelConfig, group: dist.ProcessGroup | None, sp: bool, seed: int) -> Block:
    block = Block(cfg, group, sp, TPRandom(0))
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
        sp_names = sorted(n for n, p in params.items() if p.sequence_parallel)
        partial = {n: params[n].grad.clone() for n in sp_names}
        sync_sequence_parallel_grads(list(params.values()), group)
        for n, p in params.items():
            shard = p.hybrid_shard
            pairs["d:" + n] = (p.grad, shard.slice(ref_grads[n]) if shard is not None else ref_grads[n])
        out["sp" if sp else "no_sp"] = {
            "pairs": detached(pairs), "sp_names": sp_names, "partial": partial,
            "synced": {n: params[n].grad.clone() for n in sp_names},
            "sharded": sorted(n for n, p in params.items() if p.hybrid_shard is not None),
        }
    out["ref_grads"] = {n: g.clone() for n, g in ref_grads.items()}
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_block_matches_tp1(family: str) -> None:
    results = run_ranks(block_checks, 2, family, timeout=TIMEOUT)
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


# ------------------------------------------------------------------------------- 5: DTensor reference


class NormMLP(nn.Module):
    """LayerNorm → up → GELU → down in plain torch (for DTensor's `parallelize_module`)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class TPNormMLP(NormMLP):
    """The same MLP from hybrid's layers (same parameter names)."""

    def __init__(self, group: dist.ProcessGroup, sp: bool) -> None:
        nn.Module.__init__(self)
        self.norm = Norm(H, 1e-5, rms=False, sequence_parallel=sp)
        self.up = ColumnParallelLinear(H, (FFN,), group, sequence_parallel=sp)
        self.down = RowParallelLinear(FFN, H, group, sequence_parallel=sp)


def dtensor_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    mesh = init_device_mesh("cpu", (world,))
    full = {"norm.weight": 1 + 0.1 * randn(51, H), "norm.bias": randn(52, H), "up.weight": randn(53, FFN, H),
            "up.bias": randn(54, FFN), "down.weight": randn(55, H, FFN), "down.bias": randn(56, H)}
    x, g = randn(57, B, S, H), randn(58, B, S, H)
    plain = NormMLP().double()
    load_full(plain, full)
    x_plain = leaf(x)
    y_plain = plain(x_plain)
    y_plain.backward(g)

    plans = {
        False: {"up": ColwiseParallel(), "down": RowwiseParallel()},
        True: {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=DShard(1)),
               "down": RowwiseParallel(output_layouts=DShard(1))},
    }
    out: dict[str, Any] = {}
    for sp, plan in plans.items():
        chunk = (lambda t: C.split_seq(t, group)) if sp else (lambda t: t)
        theirs = NormMLP().double()
        load_full(theirs, full)
        parallelize_module(theirs, mesh, plan)
        x_dt = leaf(chunk(x))
        y_dt = theirs(x_dt)
        y_dt.backward(chunk(g))

        ours = TPNormMLP(group, sp).double()
        load_full(ours, full)
        x_in = leaf(chunk(x))
        y = ours(x_in)
        y.backward(chunk(g))
        sync_sequence_parallel_grads(list(ours.parameters()), group)

        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in theirs.named_parameters()}
        pairs = {"y": (y, y_dt), "dx": (x_in.grad, x_dt.grad),
                 "dtensor_vs_plain y": (y_dt, chunk(y_plain)), "dtensor_vs_plain dx": (x_dt.grad, chunk(x_plain.grad))}
        for n, p in ours.named_parameters():
            shard = p.hybrid_shard
            pairs["d:" + n] = (p.grad, shard.slice(grads[n]) if shard is not None else grads[n])
            pairs["dtensor_vs_plain d:" + n] = (grads[n], dict(plain.named_parameters())[n].grad)
        out["sp" if sp else "no_sp"] = {"pairs": detached(pairs)}
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_matches_dtensor_tensor_parallel(tp: int) -> None:
    """ColwiseParallel/RowwiseParallel (and SequenceParallel) vs our column → GELU → row pair."""
    assert_ranks(run_ranks(dtensor_checks, tp, timeout=TIMEOUT))


# ------------------------------------------------------------------------ 6: full_tensor / full_state_dict


def full_tensor_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    m = nn.Module()
    m.qkv = ColumnParallelLinear(H, PARTS, group)  # dim 0, fused parts (weight and bias)
    m.row = RowParallelLinear(FFN, H, group)  # dim 1, one part; replicated bias
    cols = sum(PARTS) // world
    m.register_parameter("fused_cols", annotate(nn.Parameter(torch.empty(4, cols)), Init("zeros"),
                                                Shard(1, PARTS, rank, world)))  # dim 1, fused parts
    full = {n: randn(60 + i, *(p.shape if p.hybrid_shard is None else _global(p)))
            for i, (n, p) in enumerate(m.named_parameters())}
    m.double()
    load_full(m, full)
    gathered = full_state_dict(m, group)
    pairs = {n: (gathered[n], full[n]) for n in full}
    for n, p in m.named_parameters():
        pairs["full_tensor " + n] = (full_tensor(p, group), full[n])
        if p.hybrid_shard is not None:  # and the other way round: slicing the gathered tensor gives the shard
            pairs["reslice " + n] = (p.hybrid_shard.slice(gathered[n]), p.detach())
    return {"full": {"pairs": detached(pairs)}}


def _global(p: nn.Parameter) -> tuple[int, ...]:
    shape = list(p.shape)
    shape[p.hybrid_shard.dim] = sum(p.hybrid_shard.parts)
    return tuple(shape)


@pytest.mark.parametrize("tp", [2, 4])
def test_full_tensor_inverts_shard_slice(tp: int) -> None:
    assert_ranks(run_ranks(full_tensor_checks, tp, timeout=TIMEOUT), EXACT)


# ------------------------------------------------------------------------------------------ 7: TPRandom


def rng_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    cfg = ModelConfig(family="gpt", n_layers=1, hidden=16, n_heads=2, ffn_hidden=32, max_seq_len=16,
                      make_vocab_size_divisible_by=4, dropout=0.1)
    model = CausalLM(cfg, VOCAB, group, seed=3)  # the TP stream as the model derives it (seed, TP rank, layer)
    rng = model.rng
    assert model.layers["0"].rng is rng and model.layers["0"].attn.rng is rng

    torch.manual_seed(1234)  # the default generator: the same on every rank
    before = torch.rand(8)
    with rng.fork(torch.device("cpu")):
        first = torch.rand(16)
        mask = F.dropout(torch.ones(64), p=0.5)  # library code drawing from the default generator
    between = torch.rand(8)
    with rng.fork(torch.device("cpu")):
        second = torch.rand(16)
    after = torch.rand(8)

    torch.manual_seed(1234)  # the draws as if no fork had happened
    untouched = torch.rand(24)
    torch.manual_seed(rng.seed)  # the TP stream's draws in one go, as if both forks were one
    expected_first = torch.rand(16)
    expected_mask = F.dropout(torch.ones(64), p=0.5)
    expected_second = torch.rand(16)
    return {"rng": {"pairs": {
        "outside": (torch.cat([before, between, after]), untouched),
        "first fork": (first, expected_first),
        "dropout in fork": (mask, expected_mask),
        "second fork continues": (second, expected_second),
    }}, "first": first, "mask": mask}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_random_fork(tp: int) -> None:
    results = run_ranks(rng_checks, tp, timeout=TIMEOUT)
    assert_ranks([{"rng": r["rng"]} for r in results], EXACT)
    for r in results:
        first, second = r["rng"]["pairs"]["first fork"][0], r["rng"]["pairs"]["second fork continues"][0]
        assert not torch.equal(first, second), "the second fork must continue the stream, not repeat it"
    for a in range(tp):
        for b in range(a + 1, tp):
            assert not torch.equal(results[a]["first"], results[b]["first"]), f"TP ranks {a}, {b} share a stream"
            assert not torch.equal(results[a]["mask"], results[b]["mask"])
