"""Tensor-parallel region ops, `full_tensor` / `full_state_dict` and the TP RNG on gloo ranks, each against a reference.

References:
- for the region ops (copy / reduce / gather / split, and the sequence-parallel gather / reduce-scatter
  pair), the math their docstrings state (sum / concatenation / chunk over every rank's input),
  evaluated on each rank from every rank's (rank-seeded, hence reproducible) tensors;
- traffic: `collectives.COUNTER` against the documented byte formula (bytes = the whole tensor the
  collective works on, elements × itemsize, computed here from the tensors' shapes); `wire_bytes`
  against the ring all-reduce's 2 (n - 1) / n × payload, which the SP gather + reduce-scatter pair
  matches;
- `full_tensor` / `full_state_dict`: the full tensor every rank's shard was sliced from (dim 0 and
  dim 1, fused parts, replicated parameters), and `Shard.slice` of the gathered tensor gives back the shard;
- `TPRandom.fork`: the default generator seeded by hand: draws outside the forks are as if no fork
  had happened, draws inside (dropout included) continue one stream seeded with the TP seed, and
  that stream differs between TP ranks.

Tolerances: the region ops run in fp64 and their sums differ from the reference math only by
summation order: rtol = 1e-10, atol = 1e-12. Pure data movement (`full_tensor`, `full_state_dict`,
RNG draws) is compared exactly.

The checks run in one launch per TP size (2 and 4 ranks, once per session: `launched`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from tp_helpers import (
    EXACT,
    FFN,
    PARTS,
    TIMEOUT,
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
from hybrid.model.layers import CausalLM
from hybrid.parallel import collectives as C
from hybrid.parallel.params import Init, Shard, annotate, full_state_dict, full_tensor, param_info
from hybrid.parallel.tp.tensor import ColumnParallelLinear, RowParallelLinear

# ----------------------------------------------------------------------------------------- 1: region ops


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
        y, fwd, bwd = counted_fwd_bwd(functools.partial(op, x, group), gs[rank])
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


def every_check(rank: int, world: int) -> dict[str, Any]:
    """Rank function: the region ops, full_tensor and TPRandom checks in turn → their results by name."""
    return {"regions": region_checks(rank, world), "full": full_tensor_checks(rank, world),
            "rng": rng_checks(rank, world)}


@functools.cache
def launched(tp: int) -> dict[str, list[dict[str, Any]]]:
    """check → its results by rank, from the one launch on `tp` ranks."""
    torch.set_num_threads(1)
    results = run_ranks(every_check, tp, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in results[0]}


@pytest.mark.parametrize("tp", [2, 4])
def test_region_ops(tp: int) -> None:
    results = launched(tp)["regions"]
    ops = [r["ops"] for r in results]
    assert_ranks(ops)
    assert_traffic(ops)
    for r in results:
        all_reduce_wire, pair_wire, payload = r["wire"]
        assert all_reduce_wire == pytest.approx(2 * (tp - 1) / tp * payload)
        assert pair_wire == pytest.approx(all_reduce_wire)


# ---------------------------------------------------------------------- 2: full_tensor / full_state_dict


def full_tensor_checks(rank: int, world: int) -> dict[str, Any]:
    group = tp_group(world)
    m = nn.Module()
    m.qkv = ColumnParallelLinear(H, PARTS, group)  # dim 0, fused parts (weight and bias)
    m.row = RowParallelLinear(FFN, H, group)  # dim 1, one part; replicated bias
    cols = sum(PARTS) // world
    m.register_parameter("fused_cols", annotate(nn.Parameter(torch.empty(4, cols)), Init("zeros"),
                                                Shard(1, PARTS, rank, world)))  # dim 1, fused parts
    full = {n: randn(60 + i, *(p.shape if param_info(p).shard is None else _global(p)))
            for i, (n, p) in enumerate(m.named_parameters())}
    m.double()
    load_full(m, full)
    gathered = full_state_dict(m, group)
    pairs = {n: (gathered[n], full[n]) for n in full}
    for n, p in m.named_parameters():
        pairs["full_tensor " + n] = (full_tensor(p, group), full[n])
        if param_info(p).shard is not None:  # and the other way round: slicing the gathered tensor gives the shard
            pairs["reslice " + n] = (param_info(p).shard.slice(gathered[n]), p.detach())
    return {"full": {"pairs": detached(pairs)}}


def _global(p: nn.Parameter) -> tuple[int, ...]:
    shape = list(p.shape)
    shape[param_info(p).shard.dim] = sum(param_info(p).shard.parts)
    return tuple(shape)


@pytest.mark.parametrize("tp", [2, 4])
def test_full_tensor_inverts_shard_slice(tp: int) -> None:
    assert_ranks(launched(tp)["full"], EXACT)


# ------------------------------------------------------------------------------------------- 3: TPRandom


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
    results = launched(tp)["rng"]
    assert_ranks([{"rng": r["rng"]} for r in results], EXACT)
    for r in results:
        first, second = r["rng"]["pairs"]["first fork"][0], r["rng"]["pairs"]["second fork continues"][0]
        assert not torch.equal(first, second), "the second fork must continue the stream, not repeat it"
    for a in range(tp):
        for b in range(a + 1, tp):
            assert not torch.equal(results[a]["first"], results[b]["first"]), f"TP ranks {a}, {b} share a stream"
            assert not torch.equal(results[a]["mask"], results[b]["mask"])
