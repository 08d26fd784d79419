"""Our tensor-parallel MLP against PyTorch's DTensor tensor parallelism, a second reference.

Reference: `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`, and `SequenceParallel` with
`Shard(1)` layouts, on a CPU gloo `DeviceMesh`: a LayerNorm → up → GELU → down MLP, with and without
sequence parallelism, against the same MLP from hybrid's `Norm` / `ColumnParallelLinear` /
`RowParallelLinear` loaded with the same full weights. The DTensor run is itself checked against the
plain unsharded MLP. Both plans run on CPU/gloo in torch 2.13.

Tolerances: everything runs in fp64, so outputs and gradients differ only by summation order:
rtol = 1e-10, atol = 1e-12 (measured: max abs error 7e-14 vs DTensor).

The DTensor modules, and torch._dynamo (which `distribute_tensor` imports on first use, ~3 CPU-s), are imported
at module level, in the parent before the ranks fork: once, not per rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (distribute_tensor imports it on first use: once here, not per rank)
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh  # imported before the ranks fork: once, not per rank
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from tp_helpers import FFN, TIMEOUT, B, H, S, assert_ranks, detached, leaf, load_full, randn, tp_group

from hybrid.model.layers import Norm
from hybrid.parallel import collectives as C
from hybrid.parallel.dp.grads import sync_sequence_parallel_grads
from hybrid.parallel.params import param_info
from hybrid.parallel.tp.tensor import ColumnParallelLinear, RowParallelLinear


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
            shard = param_info(p).shard
            pairs["d:" + n] = (p.grad, shard.slice(grads[n]) if shard is not None else grads[n])
            pairs["dtensor_vs_plain d:" + n] = (grads[n], dict(plain.named_parameters())[n].grad)
        out["sp" if sp else "no_sp"] = {"pairs": detached(pairs)}
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_matches_dtensor_tensor_parallel(tp: int) -> None:
    """ColwiseParallel/RowwiseParallel (and SequenceParallel) vs our column → GELU → row pair."""
    assert_ranks(run_ranks(dtensor_checks, tp, timeout=TIMEOUT))
