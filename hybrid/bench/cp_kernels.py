"""The ring's attention math on one device against the whole sequence's SDPA: what context parallelism's block
kernels cost before any communication.

    PYTHONPATH=. python -m hybrid.bench.cp_kernels [--device auto] [--seq 8192] [--heads 16] [--head-dim 64]

One causal attention forward and backward of a --batch × --seq sequence (fp32, or --dtype bf16), two ways,
alternating A B A B for --repeats rounds after one warm-up each:

- `sdpa`: `scaled_dot_product_attention(is_causal=True)` on the whole sequence, autograd's backward;
- `ring_cp1`: `ring_attention` on a CP group of one rank holding the whole sequence: its two chunks as three
  block pairs (`parallel/cp/blocks.py`), merged by log-sum-exp, then each pair's backward from the final output
  and log-sum-exp — the CP math with cp = 1, on this device's block kernel (`blocks.fused`), no hop.

Reported: each side's median seconds and `ring_cp1 / sdpa`, and the largest difference of the outputs and the
gradients (fp32 rounding apart, they are the same attention). On CUDA it synchronizes around each timed call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hybrid.bench import common
from hybrid.parallel.cp import blocks
from hybrid.parallel.cp.ring import ring_attention

MODULE = "hybrid.bench.cp_kernels"
QUICK = {"seq": 256, "heads": 2, "head_dim": 16, "repeats": 2}
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "256 tokens, 2 heads, 2 rounds")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one) | cpu | cuda")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="q, k, v's dtype")
    p.add_argument("--seq", type=int, default=8192, help="tokens (even)")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--heads", type=int, default=16, help="query heads (K/V heads the same)")
    p.add_argument("--head-dim", type=int, default=64, help="channels per head")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, A B alternating")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = common.parse_with_quick(p, argv, QUICK)
    if args.seq % 2 or min(args.seq, args.batch, args.heads, args.head_dim, args.repeats) < 1:
        p.error("--seq must be even; --batch, --heads, --head-dim, --repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def _through_autograd(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor) -> tuple[torch.Tensor, Grads]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout)
    return out.detach(), tuple(t.grad for t in leaves)  # type: ignore[return-value]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, Grads]:
    return _through_autograd(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, dout)


def ring_cp1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, Grads]:
    """`ring_attention` itself on a CP group of one (no process group): no hop, the block math alone."""
    return _through_autograd(lambda *t: ring_attention(*t, None), q, k, v, dout)


SIDES: dict[str, Callable[..., tuple[torch.Tensor, Grads]]] = {"sdpa": sdpa, "ring_cp1": ring_cp1}


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          args.device if args.device != "auto" else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=g, device=device,
                                 dtype=dtype) for _ in range(4))
    results = {name: fn(q, k, v, dout) for name, fn in SIDES.items()}  # warm-up, and the comparison
    diff = max((a.float() - b.float()).abs().max().item() for a, b in
               zip((results["sdpa"][0], *results["sdpa"][1]), (results["ring_cp1"][0], *results["ring_cp1"][1])))
    seconds: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(args.repeats):
        for name, fn in SIDES.items():
            seconds[name].append(timed(lambda f=fn: f(q, k, v, dout), device))
    med = {name: statistics.median(s) for name, s in seconds.items()}
    out(f"\n## {device.type}, {args.dtype}, {args.batch} × {args.seq} tokens, {args.heads} heads × {args.head_dim}; "
        f"ring blocks: {'fused' if blocks.fused(device) else 'fp32 math'}; median of {args.repeats} (A B alternating)")
    rows = [[name, f"{med[name] * 1e3:.1f}", f"{med[name] / med['sdpa']:.2f}×"] for name in SIDES]
    out("\n".join(common.table(["side", "fwd+bwd ms", "vs sdpa"], rows)))
    out(f"largest difference of output and gradients: {diff:.2e}")
    return {"device": device.type, "median_s": med, "max_diff": diff}


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
