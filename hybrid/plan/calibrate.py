"""`hybrid-plan --calibrate`: the device the plan runs on, measured here instead of taken from the table.

On the machine at hand, in this process (one torch thread, as every rank runs): the FLOP/s of a GEMM of the model's
own MLP shape (a microbatch's tokens × hidden × 4·hidden, the largest of a layer), the seconds of causal attention
through torch's `scaled_dot_product_attention` over the same tokens, the bandwidth of a large copy, and the fixed
cost of a small op — then, given one of the model's own blocks, every rate scaled so that the cost model's layer
takes what that block's forward and backward take here. The device's peak is then the GEMM's rate (GEMMs at 100 % of
it) and attention at the measured share of it; on CPU the device also names the machine's cores, which a node's
ranks share (`predict` then bounds the step by the work of all of them over those cores). On a GPU the same
measurements run on `cuda` in bf16.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hybrid.plan.cost import KERNELS, OPTIMIZER_BYTES, Micro, Shape, layer_pass
from hybrid.plan.hardware import LINKS, Device


def _seconds(fn: Callable[[], object], device: str, reps: int = 3) -> float:
    """The best of `reps` timed calls after one warm-up (synchronised on CUDA); in processes forked to run at once
    (`_block_s`), each call starts when all of them start theirs — else the first to finish leave their cores to
    the rest, and the best call is one that ran with fewer rivals than a step's ranks have."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        for barrier in _TOGETHER:
            barrier.wait(timeout=600)
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(shape: Shape, tokens: int, device: str = "cpu", ranks: int = 1, memory: int = 0,
              layer: Optional[Callable[[], torch.nn.Module]] = None) -> Device:
    """The device as measured here for `shape` at `tokens` tokens a microbatch, shared by `ranks` ranks; with
    `layer` (one of the model's own blocks, hidden states in and out), its rates scaled so that the cost model's
    layer takes what that block's forward and backward take here (`fitted`)."""
    measured = _measured(shape, tokens, device, ranks, memory)
    return measured if layer is None else fitted(measured, shape, tokens, layer, ranks)


def fitted(dev: Device, shape: Shape, tokens: int, layer: Callable[[], torch.nn.Module], ranks: int = 1) -> Device:
    """`dev` refitted to the model's own block, run here at `tokens` and at a quarter of them: its time is the cost
    model's work at every rate scaled by one factor — the ops between the GEMMs — plus a fixed cost an op that does
    not shrink with the tokens (the framework's own time: what a TP-split layer keeps whole), the two solved from the
    two sizes (one size, every rate scaled, when they do not separate); the optimizer's rate from the same block's
    AdamW step with its gradients clipped, as a step ends. On CPU with more ranks than cores the block runs in
    `ranks` processes at once, as a run's ranks do, and its time is compared with the model's share of the cores
    (`predict`'s shared-core bound): caches and memory bandwidth shared the same way. Three rounds; the medians count.
    """
    share = ranks / dev.cores if dev.cores and ranks > dev.cores else 1.0
    concurrent = int(ranks if share > 1 else 1)
    rounds = [_block_s(layer, tokens, shape.hidden, dev.kind, concurrent) for _ in range(3)]
    full, small, per_element = (statistics.median(r[i] for r in rounds) / share for i in range(3))
    launches = 3 * KERNELS  # a layer's forward and its backward (twice the forward's)
    work = [model_pass_s(shape, n, dev) - launches * dev.launch_s for n in (tokens, tokens // 4)]
    scale = (full - small) / (work[0] - work[1])
    fixed = (full - scale * work[0]) / launches
    if scale <= 0 or fixed <= 0:  # noise or no fixed cost to see: one factor for everything
        scale = full / (work[0] + launches * dev.launch_s)
        fixed = dev.launch_s * scale
    return replace(dev, peak=dev.peak / scale, hbm=dev.hbm / scale, launch_s=fixed,
                   optimizer_bw=OPTIMIZER_BYTES / per_element)


def model_pass_s(shape: Shape, tokens: int, dev: Device) -> float:
    """The cost model's forward and backward of one layer at `tokens` tokens, no TP."""
    act = 2 if dev.kind == "cuda" else 4
    one = layer_pass(shape, Micro(1, tokens, act=act, sp=False), dev, "none", "none", LINKS["gloo-local"])
    return one.forward + one.backward


def _block_s(layer: Callable[[], torch.nn.Module], tokens: int, hidden: int, device: str, processes: int
             ) -> tuple[float, float, float]:
    """The medians over `processes` forked processes (running at once) of the block's forward and backward at
    `tokens` and at a quarter of them, and of its optimizer step's seconds an element."""
    def one() -> tuple[float, float, float]:
        module = layer().to(device)
        sizes = [torch.randn(1, n, hidden, device=device, requires_grad=True) for n in (tokens, tokens // 4)]
        full, small = (_seconds(lambda x=x: module(x).sum().backward(), device) for x in sizes)
        params = list(module.parameters())
        adam = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            adam.step()

        return full, small, _seconds(step, device) / sum(p.numel() for p in params)

    if processes == 1:
        return one()
    import multiprocessing as mp

    fork = mp.get_context("fork")
    _FORKED[:], _TOGETHER[:] = [one], [fork.Barrier(processes)]  # the forked workers inherit them
    try:
        with fork.Pool(processes) as pool:
            got = pool.map(_forked, range(processes))
    finally:
        _TOGETHER.clear()
    return tuple(statistics.median(g[i] for g in got) for i in range(3))  # type: ignore[return-value]


_FORKED: list[Callable[[], tuple[float, float, float]]] = []  # a closure does not pickle: the workers inherit it
_TOGETHER: list[Any] = []  # the barrier of processes timed at once


def _forked(_: int) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    return _FORKED[0]()


def _measured(shape: Shape, tokens: int, device: str, ranks: int, memory: int) -> Device:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
    w = torch.randn(shape.mlp_in, shape.hidden, device=device, dtype=dtype)
    gemm = 2 * tokens * shape.hidden * shape.mlp_in / _seconds(lambda: F.linear(x, w), device)
    heads, d = shape.heads, shape.hidden // shape.heads
    q = torch.randn(1, heads, tokens, d, device=device, dtype=dtype)
    attention = 2 * tokens * tokens * shape.hidden / _seconds(
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device)
    big = torch.empty(64 * 2**20, device=device, dtype=torch.uint8)
    hbm = 2 * big.numel() / _seconds(lambda: big.clone(), device)
    small = torch.ones(8, device=device)
    launch = _seconds(lambda: small + 1, device, reps=20)
    total = memory or (torch.cuda.get_device_properties(0).total_memory if device == "cuda" else _host_memory())
    cores = (os.cpu_count() or 1) if device == "cpu" else 0
    return Device(f"{device} (calibrated here)", gemm, total // (ranks if device == "cpu" else 1), hbm, gemm=1.0,
                  attention=min(1.0, attention / gemm), launch_s=launch, kind=device, cores=cores)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
