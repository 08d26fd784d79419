"""DP gradient compression: what each method's compute costs per MiB of gradient, and below which link
bandwidth that cost pays for the bytes it saves.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.compression_speed [--sections speed,breakeven] [--quick]

- speed: one process per allocator setting (fresh interpreters; with --processes fork forked ones, seconds
  sooner, the allocator set with mallopt), no communication, median of --repeats: the 16-bit casts and the
  int8/sign/topk codecs' encode and decode of an fp32 buffer of each --speed-mb size, PowerSGD's matmuls + QR
  (+ error feedback) on the largest multi-tensor bucket of --model; ms per MiB of fp32 gradient and each hook's
  compute per MiB at dp=n, next to the method's wire ratio from the payload formula on --model's buckets (the
  formula `hybrid.bench.compression_bytes` checks against the counted bytes).
- breakeven: the link bandwidth below which each method's sync beats the uncompressed ring all-reduce, from
  those wire ratios and speed's times (speed runs again, unprinted, when only breakeven is asked for).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, parse_with_quick, table
from hybrid.bench.compression_common import (
    GB,
    MIB,
    SPEED_METHODS,
    TWO_PHASE,
    bucket_shapes,
    compression_cfg,
    formula_ratio,
)
from hybrid.compression import powersgd
from hybrid.compression.registry import REGISTRY

MODULE = "hybrid.bench.compression_speed"
SECTIONS = ("speed", "breakeven")
QUICK = {"model": "gpt-tiny", "speed_mb": [1], "repeats": 2, "processes": "fork"}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_sections(p, SECTIONS)
    common.add_quick(p, "a 1 MiB buffer and gpt-tiny's buckets in forked processes, seconds")
    p.add_argument("--model", default="gpt-125m", help="configs/model whose largest bucket PowerSGD is "
                   "timed on and whose buckets give the wire ratios")
    p.add_argument("--speed-mb", type=int, nargs="+", default=[64, 24], help="MiB of the fp32 buffer of the casts "
                   "and codecs, one row per size")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (median) after one untimed")
    p.add_argument("--breakeven-dp", type=int, nargs="+", default=[4, 8], help="DP sizes n of the hook's compute, "
                   "the wire ratios and the break-even bandwidth")
    p.add_argument("--processes", choices=("spawn", "fork"), default="spawn", help="the timing processes: spawn "
                   "(fresh interpreters, glibc set up by MALLOC_* at start-up) or fork (forked from this one, seconds "
                   "sooner, glibc set up by mallopt, the heap's history inherited)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK, SECTIONS)
    check_models(p, args.model)
    if min(args.breakeven_dp) < 2:
        p.error("--breakeven-dp must be >= 2")
    if min(*args.speed_mb, args.repeats) < 1:
        p.error("--speed-mb and --repeats must be >= 1")
    return args


def reproduce_command(args: argparse.Namespace, sections: Optional[Sequence[str]] = None) -> str:
    """The command line that repeats this run (or only `sections` of it), every setting spelled out."""
    if sections is not None:
        args = copy.copy(args)
        args.sections = list(sections)
    return common.reproduce_command(MODULE, build_parser(), args)


def measured(args: argparse.Namespace) -> dict[str, Any]:
    """What earlier sections of this run measured (breakeven reads speed's rows from here)."""
    if not hasattr(args, "measured"):
        args.measured = {}
    return args.measured


def wire_ratios(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """{method: {n: uncompressed all-reduce wire / the method's}} of SPEED_METHODS at every --breakeven-dp."""
    buckets = bucket_shapes(args.model)
    return {m: {n: formula_ratio(m, buckets, n) for n in args.breakeven_dp} for m in SPEED_METHODS}


# ---- speed -----------------------------------------------------------------------------------------------------

def median_ms(fn: Callable[[], Any], repeats: int, setup: Optional[Callable[[], Any]] = None) -> float:
    """Median milliseconds of `fn()` over `repeats` timed calls after one untimed; `setup()` untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def cast_speed(dtype: torch.dtype, x: torch.Tensor, repeats: int, n: int = 4) -> dict[str, float]:
    """cast_hook's compute: divide by n and cast to 16 bits (compress), copy back into the fp32 bucket."""
    low, back = (x / n).to(dtype), torch.empty_like(x)
    return {"compress": median_ms(lambda: (x / n).to(dtype), repeats),
            "decompress": median_ms(lambda: back.copy_(low), repeats)}


def codec_speed(method: str, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Encode and decode of the method's codec (built by its factory from its default config), `x` as one chunk."""
    codec = REGISTRY[method](compression_cfg([f"compression={method}"]), None)[1].codec
    length = codec.chunk_len(x.numel())
    chunk = torch.zeros(length)
    chunk[: x.numel()] = x
    data = codec.encode(chunk)
    return {"compress": median_ms(lambda: codec.encode(chunk), repeats),
            "decompress": median_ms(lambda: codec.decode(data, length), repeats)}


def powersgd_speed(shapes: list[torch.Size], repeats: int, rank: int = 4, min_rate: float = 2.0) -> dict[str, float]:
    """powersgd_hook's compute on one bucket of `shapes`, its two all-reduces left out. compress: error-feedback
    add and copy, re-orthonormalise the warm-start Qs, P = M·Q, QR(P), Q = Mᵀ·P; decompress: M ← P·Qᵀ, residual."""
    numel = sum(s.numel() for s in shapes)
    source = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    buf, residual = source.clone(), 0.01 * torch.randn(numel)
    views, offset = [], 0
    for s in shapes:
        views.append(buf[offset: offset + s.numel()].view(s))
        offset += s.numel()
    mats = [(v.view(powersgd.matrix_shape(v.shape)), r) for v in views
            if (r := powersgd.compressed_rank(v.shape, rank, min_rate))]
    qs = [torch.randn(m.shape[1], r) for m, r in mats]
    state: dict[str, Any] = {}

    def compress() -> None:
        buf.add_(residual)
        state["local"] = buf.clone()
        ps = [powersgd.orthonormal(m @ powersgd.orthonormal(q)) for (m, _), q in zip(mats, qs)]
        state["pq"] = [(p, m.t() @ p) for (m, _), p in zip(mats, ps)]

    def decompress() -> None:
        for (m, _), (p, q) in zip(mats, state["pq"]):
            m.copy_(p @ q.t())
        torch.sub(state["local"], buf, out=residual)

    return {"compress": median_ms(compress, repeats, setup=lambda: buf.copy_(source)),
            "decompress": median_ms(decompress, repeats, setup=lambda: (buf.copy_(source), compress())),
            "mib": 4 * numel / MIB, "matrices": len(mats)}


def hook_compute_ms(method: str, s: dict[str, float], n: int, feedback: bool) -> float:
    """ms of the hook's compute per MiB of fp32 gradient at dp=n, from the per-MiB timings `s`.

    Two-phase: encode the n chunks + decode the n received + re-encode the own (1/n) + decode the n gathered;
    with error feedback also a decode of what was sent and of the re-encoded chunk. The others: compress +
    decompress (the casts' and PowerSGD's work per MiB does not depend on n)."""
    if method in TWO_PHASE:
        extra = (1 + 1 / n) * s["decompress"] if feedback else 0.0
        return (1 + 1 / n) * s["compress"] + 2 * s["decompress"] + extra
    return s["compress"] + s["decompress"]


def speed_row(args: argparse.Namespace, method: str, on: str, s: dict[str, float], mib: float) -> dict[str, Any]:
    """One speed row: the timings `s` of `mib` MiB per MiB, and the hook's per-MiB compute at every n."""
    per = {"compress": s["compress"] / mib, "decompress": s["decompress"] / mib}
    feedback = method in ("sign", "topk")  # their factories run error feedback (the configs' default)
    return {"method": method, "on": on, **per,
            "hook": {n: hook_compute_ms(method, per, n, feedback) for n in args.breakeven_dp}}


ALLOCATORS = {"warm": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}, "default": {}}
"""glibc settings of the speed processes. warm: every allocation from the heap, never given back, so temporaries
reuse memory whose pages are already mapped (what a caching allocator gives). default: glibc as shipped, where
allocations above 32 MiB, and smaller ones depending on the heap's history, are fresh page-faulting mappings."""


def spawned(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a freshly spawned interpreter started with `env` added (glibc reads MALLOC_* at start-up)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.apply(fn, args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_MAX_": -4}
"""glibc's mallopt parameters (M_TRIM_THRESHOLD, M_MMAP_MAX) of the MALLOC_* settings of ALLOCATORS."""


def set_allocator(env: dict[str, str]) -> None:
    """`env`'s MALLOC_* settings applied to this process's glibc with mallopt (an int: capped at 2³¹ − 1), where
    the C library has mallopt."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    for key, value in env.items():
        if mallopt is not None and key in MALLOPT:
            mallopt(MALLOPT[key], min(int(value), 2**31 - 1))


def forked(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a process forked from this one, `env`'s allocator settings applied first."""
    with mp.get_context("fork").Pool(1, initializer=set_allocator, initargs=(env,)) as pool:
        return pool.apply(fn, args)


def speed_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`timed_rows` under each of ALLOCATORS, each in a process of its own (--processes: a fresh one, so the
    figures do not depend on what ran before in this one, or a fork) with the parent's thread count: the warm
    rows, the default allocator's figures added under "default"."""
    start = spawned if args.processes == "spawn" else forked
    runs = {name: start(env, timed_rows, args, torch.get_num_threads()) for name, env in ALLOCATORS.items()}
    for row, default in zip(runs["warm"], runs["default"]):
        row["default"] = {k: default[k] for k in ("compress", "decompress", "hook")}
    return runs["warm"]


def timed_rows(args: argparse.Namespace, threads: int) -> list[dict[str, Any]]:
    """Per SPEED_METHODS entry (the casts and codecs once per --speed-mb size): compress and decompress ms per
    MiB, and the hook's per-MiB compute at each n."""
    torch.set_num_threads(threads)
    rows = []
    for mb in args.speed_mb:
        x = torch.randn(mb * MIB // 4, generator=torch.Generator().manual_seed(0))
        for method in ("fp16", "bf16"):
            s = cast_speed(torch.float16 if method == "fp16" else torch.bfloat16, x, args.repeats)
            rows.append(speed_row(args, method, f"{mb} MiB buffer", s, mb))
        rows += [speed_row(args, m, f"{mb} MiB buffer", codec_speed(m, x, args.repeats), mb) for m in TWO_PHASE]
        del x
    layers = max((s for s in bucket_shapes(args.model) if len(s) > 1), key=lambda s: sum(t.numel() for t in s))
    s = powersgd_speed(layers, args.repeats)
    rows.append(speed_row(args, "powersgd", f"{args.model} bucket of {s['mib']:.1f} MiB ({s['matrices']} of "
                          f"{len(layers)} tensors compressed)", s, s["mib"]))
    return sorted(rows, key=lambda r: SPEED_METHODS.index(r["method"]))  # stable: sizes stay in --speed-mb order


def section_speed(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compress and decompress ms per MiB of each method, one process, next to its wire ratio."""
    ratios = wire_ratios(args)  # composed here first: a forked timing process inherits the configs
    rows = speed_rows(args)
    ns = args.breakeven_dp
    sizes = [4 * sum(t.numel() for t in b) / MIB for b in bucket_shapes(args.model)]
    warm = " ".join(f"{k}={v}" for k, v in ALLOCATORS["warm"].items())
    out(f"\n## speed: compute per MiB of fp32 gradient, no communication, {torch.get_num_threads()} thread(s), median "
        f"of {args.repeats} after 1 untimed, in {'fresh' if args.processes == 'spawn' else 'forked'} processes: a "
        f"warm allocator (glibc {warm}) and, for "
        "comparison, glibc's defaults")
    body = [[r["method"], r["on"], f"{r['compress']:.3f}", f"{r['decompress']:.3f}",
             *(f"{r['hook'][n]:.3f}" for n in ns), f"{r['default']['compress']:.3f}",
             f"{r['default']['decompress']:.3f}", *(f"{ratios[r['method']][n]:.2f}×" for n in ns)] for r in rows]
    for line in table(["method", "timed on", "compress ms/MiB", "decompress ms/MiB",
                       *(f"hook ms/MiB n={n}" for n in ns), "default glibc: compress", "decompress",
                       *(f"wire ratio n={n}" for n in ns)], body):
        out(line)
    out("compress: int8/sign/topk encode the whole buffer as one chunk; fp16/bf16 divide by n and cast; powersgd: "
        "error-feedback add + copy, Q re-orthonormalised, P = M·Q, QR(P), Q = Mᵀ·P. decompress: decode, cast back, "
        "M ← P·Qᵀ + residual. hook ms/MiB at n (warm): int8 (1 + 1/n)·compress + 2·decompress (encode the n chunks, "
        "decode the n received, re-encode the own chunk, decode the n gathered); sign and topk (error feedback on) "
        "add (1 + 1/n)·decompress; the others compress + decompress. torch_fp16 and torch_powersgd do the work of "
        "fp16 and powersgd. default glibc: temporaries above 32 MiB (its largest mmap threshold), and smaller ones "
        "depending on the heap's history, are fresh mappings whose pages fault in on every call, so its figures "
        f"grow with the buffer and vary between processes. {args.model}'s {len(sizes)} buckets: median "
        f"{statistics.median(sizes):.1f} MiB, largest {max(sizes):.1f} MiB. wire ratio: the payload formula on "
        f"{args.model}'s buckets (counted against COUNTER by hybrid.bench.compression_bytes).")
    out(f"reproduce: {reproduce_command(args, ['speed'])}")
    measured(args)["speed"] = rows
    return rows


# ---- breakeven -------------------------------------------------------------------------------------------------

def breakeven_gbps(n: int, ratio: float, ms_per_mib: float) -> float:
    """B* in GB/s: below it the method's sync of 1 MiB is faster than the uncompressed ring all-reduce's."""
    saved = MIB * 2 * (n - 1) / n * (1 - 1 / ratio)  # bytes one rank does not send, per MiB of fp32 gradient
    return saved / (ms_per_mib / 1000) / GB


def section_breakeven(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Break-even link bandwidth per method at every --breakeven-dp, from the wire ratios and measured times."""
    speed = measured(args).get("speed") or speed_rows(args)
    ratios = wire_ratios(args)
    out("\n## breakeven: when compression pays. Per MiB of fp32 gradient at dp=n the uncompressed ring all-reduce "
        "sends S = 2(n−1)/n MiB per rank; a method with wire ratio R sends S/R and adds its compute t_c (speed's "
        "hook ms/MiB at n). Over a link of bandwidth B it is faster when S/B > S/(R·B) + t_c, i.e. when "
        "B < B* = S·(1 − 1/R) / t_c: links slower than B* favour the method, faster ones the plain all-reduce. "
        "(Compute not overlapped with communication, latency ignored, bandwidth-bound ring; GB = 1e9 bytes.)")
    rows, body = [], []
    for r in speed:
        row, cells = {"method": r["method"], "on": r["on"]}, [r["method"], r["on"].split(" (")[0]]
        for n in args.breakeven_dp:
            ratio = ratios[r["method"]][n]
            b, slow = breakeven_gbps(n, ratio, r["hook"][n]), breakeven_gbps(n, ratio, r["default"]["hook"][n])
            row[n] = {"ratio": ratio, "t_c": r["hook"][n], "gbps": b, "gbps_default": slow}
            cells += [f"{ratio:.2f}×", f"{r['hook'][n]:.3f}", f"{b:.3f}", f"{8 * b:.2f}", f"{slow:.3f}"]
        rows.append(row)
        body.append(cells)
    header = ["method", "t_c timed on", *(h for n in args.breakeven_dp
                                          for h in (f"n={n} R", "t_c ms/MiB", "B* GB/s", "B* Gbit/s",
                                                    "B* GB/s default glibc"))]
    for line in table(header, body):
        out(line)
    source = "this run's speed section" if measured(args).get("speed") else "speed, recomputed here (not printed)"
    out(f"R: the payload formula on {args.model}'s buckets (counted against COUNTER by "
        f"hybrid.bench.compression_bytes). t_c: {source}, warm allocator; the last column of each n uses the default "
        "allocator's t_c.")
    out(f"reproduce: {reproduce_command(args, ['breakeven'])}")
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections in order; returns their rows (for tests)."""
    sections = (("speed", section_speed), ("breakeven", section_breakeven))
    return common.run_sections(sections, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
