"""Shared pieces of the tensor-parallel rank tests (test_tp_layers, test_tp_regions, test_tp_dtensor).

Shapes, tolerances and the helpers that build tensors and a "tp" group on a rank, load a full
(global) weight into a sharded module, record `collectives.COUNTER` traffic and compare every rank's
(ours, reference) pairs. The tolerances are explained in each test file's docstring: fp64 runs differ
from their references only by summation order (TOL); pure data movement is compared exactly (EXACT).

`run_frozen` is the harness's `run_ranks` with the test process's heap frozen for the collector while the
ranks run (the other rank test files use it too).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.params import param_info

B, S, H, FFN = 2, 8, 16, 32  # S, H and FFN divide by tp = 4
PARTS = (16, 8, 8)  # a fused Q | K | V projection with fewer KV features (GQA), each part split on its own
VOCAB = 51  # not a multiple of tp: padded to 56 (tp=2) / 64 (tp=4); rank 3 of 4 holds ids 48..50 + padding
TOL = {"rtol": 1e-10, "atol": 1e-12}
EXACT = {"rtol": 0.0, "atol": 0.0}
TIMEOUT = 120

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
Traffic = dict[str, tuple[int, int]]  # op → (bytes, calls) on the group named "tp"


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


def counted_fwd_bwd(forward: Callable[[], torch.Tensor],
                    grad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Traffic, Traffic]:
    """Run `forward()`, then backward from its output (with `grad`, or a scalar's implicit 1);
    return the output and the "tp" traffic of each pass, counted separately."""
    C.COUNTER.reset()
    y = forward()
    fwd = traffic()
    C.COUNTER.reset()
    y.backward(grad)
    return y, fwd, traffic()


@torch.no_grad()
def load_full(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy each full (global) tensor into the parameter of that name: this rank's slice if sharded."""
    for name, p in module.named_parameters():
        shard = param_info(p).shard  # plain torch parameters: the full tensor
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


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """This process's objects out of the collector's sight while ranks are forked: a rank's collections (its
    own, and the clean shutdown's) scan only the rank's objects instead of touching, and so copying, every page
    of the inherited heap (~0.3 CPU-s per rank and launch in a pytest process)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_frozen(fn: Callable, world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`run_ranks` (the same arguments and results) with this process's heap frozen while the ranks run."""
    with frozen_heap():
        return run_ranks(fn, world, *args, **kwargs)
