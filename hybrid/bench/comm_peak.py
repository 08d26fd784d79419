"""Where does gloo's bus bandwidth peak on this machine, and how does the peak compare with the machine's
memory-copy bandwidth, the physical limit of a loopback transport?

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.comm_peak [--worlds 2 4 8] [--quick]

For each world size, `hybrid-commbench -o all_reduce,all_gather -b 8 -e 128M -f 4` runs on forked gloo
ranks (`hybrid.testing.ranks.launch`, 1 torch thread each; a world larger than the core count is
oversubscribed and says so). Then one thread copies a 128 MiB tensor into another (`Tensor.copy_`,
median of the repeats): the payload rate is bytes / time, the memory traffic twice that (read + write).
Loopback TCP copies every byte at least twice (into the socket buffer and out of it) and the reduction
reads two operands, so the busbw of a loopback all-reduce cannot reach the payload copy rate of one
core. The summary gives the peak busbw per world and op (over both the out-of-place and the in-place
column), the size where it occurs and its ratio to the single-thread copy rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.tools import commbench

MODULE = "hybrid.bench.comm_peak"
QUICK = {"worlds": [2], "maxbytes": "4K", "iters": 2, "warmup": 1, "copy_mib": 8, "copy_repeats": 3}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "2 ranks up to 4 KiB, seconds")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="world sizes, one launch each")
    p.add_argument("--ops", default="all_reduce,all_gather", help="hybrid-commbench -o")
    p.add_argument("--minbytes", default="8", help="hybrid-commbench -b")
    p.add_argument("--maxbytes", default="128M", help="hybrid-commbench -e")
    p.add_argument("--factor", type=int, default=4, help="hybrid-commbench -f")
    p.add_argument("--iters", type=int, default=5, help="hybrid-commbench -n")
    p.add_argument("--warmup", type=int, default=2, help="hybrid-commbench -w")
    p.add_argument("--check", type=int, choices=(0, 1), default=1, help="hybrid-commbench -c")
    p.add_argument("--copy-mib", type=int, default=128, help="MiB of the single-thread Tensor.copy_")
    p.add_argument("--copy-repeats", type=int, default=10, help="timed copies (median)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per world before its ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = common.parse_with_quick(p, argv, QUICK)
    if min(args.worlds) < 2 or args.copy_mib < 1 or args.copy_repeats < 1:
        p.error("--worlds must be >= 2, --copy-mib and --copy-repeats >= 1")
    return args


def commbench_argv(args: argparse.Namespace) -> list[str]:
    return ["-o", args.ops, "-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.factor), "-n", str(args.iters),
            "-w", str(args.warmup), "-c", str(args.check)]


def bench_rank(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """hybrid-commbench on this rank; the report and, per op, (size, column, busbw, algbw) of every cell."""
    outcome = commbench.execute(argv)
    cells = {t.op: [(r.size, name, c.busbw, c.algbw) for r in t.rows
                    for name, c in (("out-of-place", r.out_of_place), ("in-place", r.in_place)) if c is not None]
             for t in outcome.tables}
    return {"code": outcome.code, "text": outcome.text if rank == 0 else "", "cells": cells}


def copy_rate(nbytes: int, repeats: int) -> float:
    """Payload GB/s of one thread's `Tensor.copy_` of `nbytes` (median of `repeats` after one warm-up)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(times[1:]) / 1e9


def section_peak(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """The tables per world, the copy rate, and the peak busbw per world and op against it."""
    cores, argv = os.cpu_count() or 1, commbench_argv(args)
    copy = copy_rate(args.copy_mib * 2 ** 20, args.copy_repeats)
    out(f"\n## memcpy: Tensor.copy_ of {args.copy_mib} MiB on 1 thread: {copy:.2f} GB/s of payload "
        f"({2 * copy:.2f} GB/s of memory traffic, read + write; median of {args.copy_repeats})")
    peaks = []
    for world in args.worlds:
        load = "" if world <= cores else f", oversubscribed {world / cores:g}× (1 thread per rank)"
        out(f"\n## world {world}: {world} gloo ranks on {cores} cores{load}; hybrid-commbench {' '.join(argv)}\n")
        t = time.perf_counter()
        res = launch(bench_rank, world, argv, timeout=args.timeout, init_timeout_s=300.0)
        out(res[0]["text"] + f"\n({time.perf_counter() - t:.0f} s, exit status {res[0]['code']})")
        for op, cells in res[0]["cells"].items():
            size, column, peak, alg = max(cells, key=lambda c: c[2])
            peaks.append({"world": world, "op": op, "busbw": peak, "algbw": alg, "size": size, "column": column,
                          "ratio": peak / copy, "code": res[0]["code"]})
    out(f"\n## peak bus bandwidth against the 1-thread copy rate ({copy:.2f} GB/s)\n")
    rows = [(p["world"], p["op"], f"{p['busbw']:.3f}", f"{p['size']:,}", p["column"], f"{p['algbw']:.3f}",
             f"{p['ratio']:.3f}") for p in peaks]
    for line in common.table(["world", "op", "peak busbw GB/s", "at size (B)", "column", "algbw GB/s",
                              "busbw / copy"], rows):
        out(line)
    return {"copy_gbps": copy, "peaks": peaks}


def reproduce_command(args: argparse.Namespace) -> str:
    return common.reproduce_command(MODULE, build_parser(), args)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns the copy rate and the peaks (for tests)."""
    return common.run_one(section_peak, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
