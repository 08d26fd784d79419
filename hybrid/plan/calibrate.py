"""`hybrid-plan --calibrate`: the device the plan runs on, measured here instead of taken from the table.

On the machine at hand, in this process (one torch thread, as every rank runs): the FLOP/s of a GEMM of the
model's own MLP shape (a microbatch's tokens × hidden × 4·hidden, the largest of a layer), the seconds of causal
attention through torch's `scaled_dot_product_attention` over the same tokens, the bandwidth of a large copy, and
the fixed cost of a small op. The device's peak is then the GEMM's rate (GEMMs at 100 % of it), attention at the
measured share of it, and, where `ranks` share the machine's `cores`, every rate scaled by cores / ranks (a rank
gets its share of the cores). On a GPU the same measurements run on `cuda` in bf16.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid.plan.cost import Shape
from hybrid.plan.hardware import Device


def _seconds(fn: Callable[[], object], device: str, reps: int = 3) -> float:
    """The best of `reps` timed calls after one warm-up (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(shape: Shape, tokens: int, device: str = "cpu", ranks: int = 1, memory: int = 0) -> Device:
    """The device as measured here for `shape` at `tokens` tokens a microbatch, shared by `ranks` ranks."""
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
    share = min(1.0, (os.cpu_count() or 1) / ranks) if device == "cpu" else 1.0
    total = memory or (torch.cuda.get_device_properties(0).total_memory if device == "cuda" else _host_memory())
    return Device(f"{device} (calibrated here)", gemm * share, total // (ranks if device == "cpu" else 1),
                  hbm * share, gemm=1.0, attention=min(1.0, attention / gemm), launch_s=launch,
                  kind=device)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
