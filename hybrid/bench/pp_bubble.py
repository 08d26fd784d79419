"""Pipeline parallelism on gloo CPU ranks: the measured bubble of each schedule against the simulator's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp_bubble [--microbatches 4 8] [--quick]

pp=2 on 2 forked ranks; gpipe, 1f1b and interleaved (v=2) through `run_schedule` for every --microbatches.
Per rank: bubble = 1 − compute (`PipelineStats`) / step time (the slowest rank's, from a common barrier), median
of --steps; beside it `simulate()` at the measured f, b (mean of the ranks, and the slower rank's) and the
unit-cost (p−1)/(v·m+p−1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import parse_with_quick
from hybrid.bench.pp_common import (
    CPU,
    add_run_options,
    bench_cfg,
    check_run_options,
    forward_step,
    microbatches,
    pp_context,
)
from hybrid.parallel.pipeline import P2P, PipelineStats, run_schedule
from hybrid.parallel.schedules import SCHEDULES, build_schedule
from hybrid.parallel.simulator import simulate
from hybrid.testing.ranks import launch
from hybrid.trainer import build_chunks

MODULE = "hybrid.bench.pp_bubble"
BUBBLE_SCHEDULES = tuple((name, s.min_virtual_stages) for name, s in SCHEDULES.items())  # (name, v): every schedule
QUICK = {"vocab": 300, "seq": 16, "micro_batch": 1, "microbatches": [2], "steps": 1, "warmup": 0, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "tiny sizes, one step each, seconds")
    add_run_options(p, layers=4, layers_help="model.n_layers (pp·v = 4 parts)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="m, one row per value")
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take about half a minute on 2 idle cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_run_options(p, args, min_layers=4)
    if min(args.steps, *args.microbatches) < 1 or any(m % 2 for m in args.microbatches):
        p.error("--steps must be >= 1 and --microbatches even (interleaved)")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def analytic_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle share of a step at unit costs: (p−1)/(v·m+p−1)."""
    return (pp - 1) / (v * m + pp - 1)


def measured_bubble(walls: list[list[float]], busy: list[list[float]]) -> list[float]:
    """Per rank: the median over steps of 1 − busy / step time, the step time being the slowest rank's."""
    steps = [max(w) for w in zip(*walls)]
    return [statistics.median(1 - b / t for b, t in zip(rank_busy, steps)) for rank_busy in busy]


def bubble_cfgs(args: argparse.Namespace) -> list[Any]:
    """The config of each BUBBLE_SCHEDULES entry (composed once in the parent: Hydra is slow on busy cores)."""
    gbs = args.micro_batch * args.microbatches[0]
    return [bench_cfg(args, f"model.n_layers={args.layers}", "parallel.pp=2", f"parallel.schedule={name}",
                      f"parallel.virtual_stages={v}", f"train.global_batch_size={gbs}") for name, v in BUBBLE_SCHEDULES]


def bubble_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any]) -> dict[tuple[str, int], dict]:
    """Per (schedule, m): this rank's step walls, busy seconds, forward and backward seconds per microbatch."""
    out = {}
    for (name, v), cfg in zip(BUBBLE_SCHEDULES, cfgs):
        ctx = pp_context(cfg, world)
        chunks = build_chunks(cfg, args.vocab, ctx)
        p2p = P2P(ctx.pp_group, (args.micro_batch, args.seq, cfg.model.hidden), torch.float32, CPU)
        for m in args.microbatches:
            schedule, step = build_schedule(name, world, m, v), forward_step(chunks, microbatches(args.vocab, m,
                                                                             args.micro_batch, args.seq))
            walls, stats = [], []
            for i in range(args.warmup + args.steps):
                chunks.zero_grad(set_to_none=True)
                st = PipelineStats()
                dist.barrier()
                start = time.perf_counter()
                run_schedule(schedule, ctx.pp_rank, step, p2p, st)
                if i >= args.warmup:
                    walls.append(time.perf_counter() - start)
                    stats.append(st)
            out[(name, m)] = {"walls": walls, "busy": [s.busy_s for s in stats],
                              "forward": statistics.mean(f for s in stats for f in s.forward_s) * v,
                              "backward": statistics.mean(b for s in stats for b in s.backward_s) * v}
    return out


def bottleneck_bubble(name: str, pp: int, m: int, v: int, forward: list[float], backward: list[float]) -> list[float]:
    """Per rank: 1 − m·(f_r + b_r) / makespan, the makespan simulated at the slowest rank's f, b (which paces
    every stage), the rank's busy time its own measured m·(f_r + b_r)."""
    f, b = max(forward), max(backward)
    makespan = simulate(build_schedule(name, pp, m, v), forward=f, backward=b).makespan
    return [1 - m * (fr + br) / makespan for fr, br in zip(forward, backward)]


def section_bubble(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Measured bubble per rank vs the simulator at the measured costs vs the unit-cost analytic."""
    res = launch(bubble_rank, 2, args, bubble_cfgs(args), timeout=args.timeout)
    out(f"\n## bubble: pp=2 on 2 ranks, {args.model} cut to {args.layers} layers (pp·v parts), vocab {args.vocab}, "
        f"micro batch {args.micro_batch} × {args.seq} tokens, fp32, median of {args.steps} steps after {args.warmup}")
    out("schedule        |  m | f ms r0/r1 | b ms r0/r1 | measured r0/r1 | simulated mean f,b | simulated slowest "
        "r0/r1 | analytic")
    out("----------------|----|------------|------------|----------------|--------------------|------------------"
        "------|---------")
    rows = []
    for name, v in BUBBLE_SCHEDULES:
        for m in args.microbatches:
            per = [r[(name, m)] for r in res]
            fs, bs = [p["forward"] for p in per], [p["backward"] for p in per]
            sim = simulate(build_schedule(name, 2, m, v), forward=statistics.mean(fs), backward=statistics.mean(bs))
            row = {"schedule": name, "v": v, "m": m, "simulated": sim.bubble, "analytic": analytic_bubble(2, m, v),
                   "measured": measured_bubble([p["walls"] for p in per], [p["busy"] for p in per]),
                   "slowest": bottleneck_bubble(name, 2, m, v, fs, bs)}
            rows.append(row)
            label = name + (f" v={v}" if v > 1 else "")
            out(f"{label:15s} | {m:2d} | {fs[0] * 1e3:4.0f}/{fs[1] * 1e3:<5.0f} | "
                f"{bs[0] * 1e3:4.0f}/{bs[1] * 1e3:<5.0f} | "
                f"{row['measured'][0]:.3f}/{row['measured'][1]:.3f}    | {row['simulated']:18.3f} | "
                f"{row['slowest'][0]:.3f}/{row['slowest'][1]:.3f}             | {row['analytic']:.3f}")
    out("bubble = 1 − compute / step time; a step's time is the slowest rank's, from a common barrier. f, b: mean "
        "measured seconds of one microbatch through a rank's whole stage (a chunk's × v). 'simulated mean f,b' runs "
        "simulate() at the mean over both ranks (it models equal stages); 'simulated slowest' at the slower rank's "
        "f, b, each rank busy for its own m·(f+b): the last stage's head and loss outweigh the first's embedding. "
        "On 2 shared CPU cores gloo's p2p copies over local TCP, the send/recv rendezvous waits and the OS "
        "scheduler add idle time the simulator does not model: expect measured ≳ simulated, up to timing noise.")
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_bubble, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
