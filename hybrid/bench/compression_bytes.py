"""DP gradient compression on gloo CPU ranks: payload bytes of one gradient sync per method, counted against
the library's formula, and the wire ratio against the uncompressed fp32 all-reduce.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.compression_bytes [--dp 2 4 8] [--quick]

One gradient sync of --model's DP buckets (parameters built on the meta device, `assign_buckets` with the
trainer's default `parallel.bucket_mb`, real fp32 buffers filled with N(0, 1)) through each method's hook
(`make_hook`, as `hybrid.train` calls it) on dp forked gloo ranks as 2 emulated nodes (ranks_per_node = dp/2;
only hierarchical cares). A method's warm-up steps (torch_powersgd's start_powerSGD_iter) run uncounted first.
COUNTER's payload per DP group (dp, dp_intra, dp_inter) is printed next to the library's payload formula
(4N and 2N bytes for the all-reduces, `codecs.payload_bytes`, `powersgd.payload_bytes`, hierarchical's
ranges), and the ring wire bytes one rank sends give ratio = uncompressed all-reduce wire / method wire,
checked against the targets. From --alone-from ranks on, each bucket is synced by itself (fresh hook and
buffer) and the counts summed: the same bytes with one bucket's memory per rank.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick, table, verdict
from hybrid.bench.compression_common import (
    BYTES_METHODS,
    GIB,
    MIB,
    bucket_params,
    bucket_shapes,
    compression_cfg,
    formula_payload,
)
from hybrid.bench.memory import proc_status_kb
from hybrid.compression.defaults import warmup_of
from hybrid.compression.hooks import make_hook
from hybrid.compression.registry import Hook
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.buckets import GradBucket
from hybrid.parallel.dp.data import DP_GROUPS

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

MODULE = "hybrid.bench.compression_bytes"
TARGETS = {"fp16": 2.0, "bf16": 2.0, "int8": 3.5, "int4": 6.5, "sign": 20.0, "topk": 20.0, "powersgd": 20.0}
"""The targets: uncompressed all-reduce wire bytes / the method's, at least this."""
QUICK = {"model": "gpt-tiny", "dp": [2], "timeout": 300.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny at dp=2, seconds")
    p.add_argument("--model", default="gpt-125m", help="configs/model whose DP buckets are synced")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8], help="DP sizes (even: 2 nodes)")
    p.add_argument("--alone-from", type=int, default=8, help="from this dp on, sync each bucket by itself "
                   "with a fresh hook (the same bytes, one bucket's memory per rank)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a set of ranks is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if any(n < 2 or n % 2 for n in args.dp):
        p.error("--dp must be even (2 emulated nodes)")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def fill_(buckets: list[GradBucket], seed: int) -> None:
    """N(0, 1) gradients, different on every rank (`seed`)."""
    gen = torch.Generator().manual_seed(seed)
    for b in buckets:
        torch.randn(b.buffer().shape, generator=gen, out=b.buffer())


def sync_step(hook: Hook, state: Any, buckets: list[GradBucket]) -> None:
    """One step of GradSync's protocol: every bucket's hook launched in index order, then all waited."""
    futures = [hook(state, b) for b in buckets]
    for b, fut in zip(buckets, futures):
        result = fut.wait()
        result = result[0] if isinstance(result, list) else result
        if result.data_ptr() != b.buffer().data_ptr():
            b.buffer().copy_(result)


def counted_sync(ctx: ParallelContext, ccfg: CompressionConfig, buckets: list[GradBucket], seed: int) -> dict[str, Any]:
    """One counted sync step of `buckets` through a fresh hook of `ccfg`, after its warm-up steps (uncounted:
    our exact warm-up, torch's start_powerSGD_iter); COUNTER's payload and wire bytes per DP group, seconds."""
    hook, state = make_hook(ccfg, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
    for step in range(warmup_of(ccfg, None)):
        fill_(buckets, seed + step + 1)
        sync_step(hook, state, buckets)
    fill_(buckets, seed)
    C.COUNTER.reset()
    start = time.perf_counter()
    sync_step(hook, state, buckets)
    return {"sync_s": time.perf_counter() - start, "payload": {g: C.COUNTER.group_bytes(g) for g in DP_GROUPS},
            "wire": {g: C.COUNTER.wire_bytes(g) for g in DP_GROUPS}}


def summed(parts: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The per-group sums of `key` over `parts`, groups with nothing left out."""
    total = {g: sum(p[key][g] for p in parts) for g in DP_GROUPS}
    return {g: v for g, v in total.items() if v}


def bytes_rank(rank: int, world: int, model: str, methods: list[tuple[str, Any]], alone: bool) -> list[dict]:
    """Per method: COUNTER's payload and wire bytes per DP group of one counted sync step on this rank.

    alone=False: all buckets in one step, launched in index order, then waited (as GradSync). alone=True: each
    bucket synced by itself with a fresh hook and buffer and the counts summed (the same bytes: every payload is
    a per-bucket function of the shapes), so a rank holds one bucket's gradients and residuals at a time."""
    ctx = ParallelContext.build(Layout.create(world, ranks_per_node=world // 2))
    groups, _ = bucket_params(model)

    def bucket(i: int, last: bool) -> GradBucket:
        return GradBucket(i, torch.empty(sum(p.numel() for p in groups[i])), groups[i], last)

    whole = None if alone else [bucket(i, i == len(groups) - 1) for i in range(len(groups))]
    rows = []
    for label, ccfg in methods:
        if alone:
            parts = [counted_sync(ctx, ccfg, [bucket(i, True)], 1000 * rank + 10 * i) for i in range(len(groups))]
        else:
            parts = [counted_sync(ctx, ccfg, whole, 1000 * rank)]
        rows.append({"method": label, "rank": rank, "sync_s": sum(p["sync_s"] for p in parts),
                     "payload": summed(parts, "payload"), "wire": summed(parts, "wire")})
        gc.collect()
    peak = proc_status_kb(Path("/proc/self/status").read_text(), "VmHWM") * 1024
    return [{**r, "peak_rss": peak} for r in rows]


def bytes_rows(args: argparse.Namespace, n: int, methods: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """One row per method at dp=n: rank 0's counted payload, every rank's checked against the formula; the
    largest wire bytes of a rank; ratio to the uncompressed row; the target's verdict."""
    shapes = bucket_shapes(args.model)
    per_rank = launch(bytes_rank, n, args.model, methods, n >= args.alone_from, timeout=args.timeout)
    rows = []
    for i, (label, ccfg) in enumerate(methods):
        ranks = [r[i] for r in per_rank]
        formulas = [formula_payload(ccfg, shapes, n, n // 2, r["rank"]) for r in ranks]
        rows.append({"method": label, "dp": n, "payload": ranks[0]["payload"], "formula": formulas[0],
                     "equal": all(r["payload"] == f for r, f in zip(ranks, formulas)),
                     "wire": max(sum(r["wire"].values()) for r in ranks),
                     "inter_wire": max(r["wire"].get("dp_inter", 0.0) for r in ranks),
                     "sync_s": max(r["sync_s"] for r in ranks), "peak_rss": max(r["peak_rss"] for r in ranks),
                     "alone": n >= args.alone_from})
    plain = next(r["wire"] for r in rows if r["method"] == "none")
    for r in rows:
        r["ratio"] = plain / r["wire"]
        r["inter_ratio"] = plain / r["inter_wire"] if r["inter_wire"] else None
        r["target"] = TARGETS.get(r["method"])
        r["pass"] = None if r["target"] is None else r["ratio"] >= r["target"] * (1 - 1e-12)
    return rows


def print_bytes(args: argparse.Namespace, rows: list[dict[str, Any]], out: Callable[[str], None]) -> None:
    """The bytes table and what its columns mean."""
    groups, bucket_mb = bucket_params(args.model)
    numel = sum(p.numel() for ps in groups for p in ps)
    out(f"\n## bytes: DP gradient sync of {args.model}: {numel:,} fp32 gradient elements = {4 * numel / MIB:.1f} MiB "
        f"per rank in {len(groups)} buckets of ~{bucket_mb:g} MB (parallel.bucket_mb default); one counted step per "
        f"method on dp forked gloo ranks = 2 emulated nodes; dp ∈ {{{', '.join(map(str, args.dp))}}}")
    body = []
    for r in rows:
        body.append([r["method"], r["dp"], " + ".join(f"{g} {v:,}" for g, v in r["payload"].items()),
                     f"{sum(r['formula'].values()):,}", r["equal"], f"{r['wire'] / MIB:.3f}", f"{r['ratio']:.2f}×",
                     f"{r['inter_ratio']:.2f}×" if r["inter_ratio"] else "-",
                     f"≥ {r['target']:g}×" if r["target"] else "-", verdict(r["pass"]),
                     "alone" if r["alone"] else "whole", f"{r['sync_s']:.2f}"])
    for line in table(["method", "dp", "counted payload bytes (rank 0, per group)", "formula bytes", "equal",
                       "wire MiB/rank", "ratio", "inter-node ratio", "target", "verdict", "step", "sync s"], body):
        out(line)
    out("payload = COUNTER bytes (all-reduce: the reduced tensor; all-to-all: its input; all-gather: its output; "
        "reduce-scatter: its input); `equal` checks every rank (hierarchical's ranges differ by a row between "
        "ranks). wire = what one rank sends with ring algorithms (all-reduce 2(n−1)/n, the others (n−1)/n of the "
        "payload), the largest rank's. ratio = uncompressed all-reduce wire / the method's wire over all DP groups; "
        "inter-node ratio = the same over the dp_inter group only (what hierarchical sends over the slow link). "
        "step: whole = all buckets in one step as GradSync launches them; alone = each bucket by itself with a "
        f"fresh hook, counts summed (dp ≥ --alone-from {args.alone_from}, for memory). torch_powersgd: counted after "
        "its start_powerSGD_iter = 2 uncounted steps. sync s: the counted step's wall time (2 cores, gloo on "
        "loopback: not a link-speed figure).")


def section_bytes(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Counted vs formula DP payload and the wire ratio of every BYTES_METHODS entry at every --dp."""
    methods = [(label, compression_cfg(o)) for label, o in BYTES_METHODS]
    rows, failed = [], []
    for n in args.dp:
        try:
            rows += bytes_rows(args, n, methods)
        except (RuntimeError, TimeoutError) as e:  # e.g. a rank killed for memory: report, keep the other sizes
            failed.append(f"dp={n}: {str(e).splitlines()[0]}")
    print_bytes(args, rows, out)
    peaks = {r["dp"]: r["peak_rss"] for r in rows}
    out("peak RSS per rank (VmHWM, largest rank, the parent's pages shared by fork included): "
        + ", ".join(f"dp={n} {b / GIB:.2f} GiB" for n, b in peaks.items()))
    for line in failed:
        out(f"FAILED {line}")
    out(f"all counted payloads equal the formulas: {all(r['equal'] for r in rows)}; targets met: "
        f"{sum(1 for r in rows if r['pass'])}/{sum(1 for r in rows if r['pass'] is not None)}")
    return rows + [{"method": "(failed)", "dp": None, "equal": False, "pass": None, "error": f} for f in failed]


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_bytes, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when a counted DP payload differs from the library's formula or a launch failed
    (missed ratio targets are reported in the table, not failed)."""
    return 0 if all(r["equal"] for r in run(parse_args(argv))) else 1


if __name__ == "__main__":
    sys.exit(main())
