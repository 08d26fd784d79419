"""Pipeline parallelism on gloo CPU ranks: the measured bubble of each schedule against the simulator's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp_bubble [--pp 2] [--microbatches 4 8] [--quick]

pp ranks forked (2 or 4); every registered schedule (gpipe, 1f1b, interleaved v=2, zb1p, zbv v=2) through
`run_schedule` for every --microbatches. Per rank: bubble = 1 − compute (`PipelineStats`: forwards, backwards or
input passes, weight passes) / step time (the slowest rank's, from a common barrier), median of --steps; beside
it `simulate()` at the measured f, b, w (mean of the ranks, and the slowest rank's), the unit-cost analytic
figure ((p−1)/(v·m+p−1); zb1p: (p−1)/(3m+p−1) at F = I = W; zbv: the simulator at unit costs), and each
schedule's step time against 1f1b's next to the simulator's prediction at the measured costs. The zero-bubble
schedules run their own orders (zb1p = ZB-H1), as `parallel.zb_memory=none`; `bench.zb_memory` measures the
orders the trainer fits to memory by default.
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
from hybrid.bench.common import launch, parse_with_quick
from hybrid.bench.pp_common import (
    CPU,
    add_run_options,
    bench_cfg,
    check_run_options,
    forward_step,
    microbatches,
    pp_context,
)
from hybrid.parallel.context import pp_streams
from hybrid.parallel.pp.pipeline import P2P, PipelineStats, run_schedule
from hybrid.parallel.pp.schedules import SCHEDULES, build_schedule
from hybrid.parallel.pp.simulator import simulate
from hybrid.trainer import build_chunks

MODULE = "hybrid.bench.pp_bubble"
BUBBLE_SCHEDULES = tuple((name, s.min_virtual_stages) for name, s in SCHEDULES.items())  # (name, v): every schedule
QUICK = {"vocab": 300, "seq": 16, "micro_batch": 1, "layers": 4, "microbatches": [2], "steps": 1, "warmup": 0,
         "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "tiny sizes, one step each, seconds")
    add_run_options(p, layers=8, layers_help="model.n_layers (at least pp·v parts)")
    p.add_argument("--pp", type=int, default=2, choices=[2, 4], help="pipeline ranks (forked processes)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="m, one row per value")
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take about half a minute on 2 idle cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_run_options(p, args, min_layers=2 * args.pp)
    if min(args.steps, *args.microbatches) < 1 or any(m % args.pp for m in args.microbatches):
        p.error("--steps must be >= 1 and --microbatches multiples of --pp (interleaved)")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def analytic_bubble(pp: int, m: int, v: int = 1, name: str = "1f1b") -> float:
    """Idle share of a step at unit costs: (p−1)/(v·m+p−1); zb1p (p−1)/(3m+p−1) at F = I = W (the zero-bubble
    paper's (p−1)(F+I−W) over m(F+I+W)); zbv has no closed form: the simulator at those costs."""
    if name == "zb1p":
        return (pp - 1) / (3 * m + pp - 1)
    if name == "zbv":
        return simulate(build_schedule(name, pp, m, v), 1.0, 2.0, weight=1.0).bubble
    return (pp - 1) / (v * m + pp - 1)


def measured_bubble(walls: list[list[float]], busy: list[list[float]]) -> list[float]:
    """Per rank: the median over steps of 1 − busy / step time, the step time being the slowest rank's."""
    steps = [max(w) for w in zip(*walls)]
    return [statistics.median(1 - b / t for b, t in zip(rank_busy, steps)) for rank_busy in busy]


def bubble_cfgs(args: argparse.Namespace) -> list[Any]:
    """The config of each BUBBLE_SCHEDULES entry (composed once in the parent: Hydra is slow on busy cores)."""
    gbs = args.micro_batch * args.microbatches[0]
    return [bench_cfg(args, f"model.n_layers={args.layers}", f"parallel.pp={args.pp}", f"parallel.schedule={name}",
                      f"parallel.virtual_stages={v}", f"train.global_batch_size={gbs}") for name, v in BUBBLE_SCHEDULES]


def bubble_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any]) -> dict[tuple[str, int], dict]:
    """Per (schedule, m): this rank's step walls, busy seconds, forward, backward (or input-pass) and weight-pass
    seconds per microbatch."""
    out = {}
    for (name, v), cfg in zip(BUBBLE_SCHEDULES, cfgs):
        ctx = pp_context(cfg, world)
        chunks = build_chunks(cfg, args.vocab, ctx)
        streams = pp_streams(ctx, build_schedule(name, world, args.microbatches[0], v).streams)
        p2p = P2P(ctx.pp_group, (args.micro_batch, args.seq, cfg.model.hidden), torch.float32, CPU, streams)
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
                              "forward": per_microbatch([s.forward_s for s in stats], m, v),
                              "weight": per_microbatch([s.weight_s for s in stats], m, v)}
            out[(name, m)]["backward"] = per_microbatch([s.backward_s for s in stats], m, v) + out[(name, m)]["weight"]
    return out


def per_microbatch(seconds: list[list[float]], m: int, v: int) -> float:
    """Mean seconds of one microbatch through the rank's whole stage (every chunk): a step's total over m."""
    return statistics.mean(sum(step) for step in seconds) / m if seconds else 0.0


def split_weight(name: str, weight: float) -> Optional[float]:
    return weight if SCHEDULES[name].split_backward else None


def bottleneck_bubble(name: str, pp: int, m: int, v: int, forward: list[float], backward: list[float],
                      weight: list[float]) -> list[float]:
    """Per rank: 1 − m·(f_r + b_r) / makespan, the makespan simulated at the slowest rank's f, b, w (which paces
    every stage), the rank's busy time its own measured m·(f_r + b_r)."""
    f, b, w = max(forward), max(backward), max(weight)
    makespan = simulate(build_schedule(name, pp, m, v), forward=f, backward=b, weight=split_weight(name, w)).makespan
    return [1 - m * (fr + br) / makespan for fr, br in zip(forward, backward)]


def bubble_row(res: list[dict], name: str, v: int, m: int, pp: int) -> dict[str, Any]:
    """One (schedule, m): the ranks' measured costs and bubble, the simulator's and the analytic figure."""
    per = [r[(name, m)] for r in res]
    fs, bs, ws = ([p[k] for p in per] for k in ("forward", "backward", "weight"))
    f, b, w = statistics.mean(fs), statistics.mean(bs), statistics.mean(ws)
    sim = simulate(build_schedule(name, pp, m, v), forward=f, backward=b, weight=split_weight(name, w))
    walls = [p["walls"] for p in per]
    return {"schedule": name, "v": v, "m": m, "f": f, "b": b, "w": w, "simulated": sim.bubble,
            "makespan": sim.makespan, "analytic": analytic_bubble(pp, m, v, name),
            "measured": measured_bubble(walls, [p["busy"] for p in per]),
            "slowest": bottleneck_bubble(name, pp, m, v, fs, bs, ws),
            "step_s": statistics.median(max(w) for w in zip(*walls))}


def section_bubble(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Measured bubble per rank vs the simulator at the measured costs vs the unit-cost analytic."""
    pp = args.pp
    res = launch(bubble_rank, pp, args, bubble_cfgs(args), timeout=args.timeout)
    out(f"\n## bubble: pp={pp} on {pp} ranks, {args.model} cut to {args.layers} layers (pp·v parts), vocab "
        f"{args.vocab}, micro batch {args.micro_batch} × {args.seq} tokens, fp32, median of {args.steps} steps after "
        f"{args.warmup}")
    out("schedule        |  m | f ms mean | b ms mean (w) | measured (mean over ranks) | simulated mean f,b,w | "
        "simulated slowest | analytic | step / 1f1b's | simulated step / 1f1b's")
    out("----------------|----|-----------|---------------|----------------------------|----------------------|"
        "-------------------|----------|---------------|------------------------")
    rows = []
    for name, v in BUBBLE_SCHEDULES:
        for m in args.microbatches:
            rows.append(bubble_row(res, name, v, m, pp))
    for row in rows:
        base = next(r for r in rows if r["schedule"] == "1f1b" and r["m"] == row["m"])
        row["step_ratio"], row["sim_ratio"] = row["step_s"] / base["step_s"], row["makespan"] / base["makespan"]
        label = row["schedule"] + (f" v={row['v']}" if row["v"] > 1 else "")
        out(f"{label:15s} | {row['m']:2d} | {row['f'] * 1e3:9.1f} | {row['b'] * 1e3:6.1f} ({row['w'] * 1e3:4.1f}) | "
            f"{statistics.mean(row['measured']):26.3f} | {row['simulated']:20.3f} | "
            f"{statistics.mean(row['slowest']):17.3f} | {row['analytic']:8.3f} | {row['step_ratio']:13.3f} | "
            f"{row['sim_ratio']:.3f}")
    out("bubble = 1 − compute / step time; a step's time is the slowest rank's, from a common barrier. f, b: mean "
        "measured seconds of one microbatch through a rank's whole stage (every chunk); b is the whole backward, w "
        "its weight pass under a split backward. 'simulated mean f,b,w' runs "
        "simulate() at the mean over the ranks (it models equal stages); 'simulated slowest' at the slowest rank's "
        "f, b, w, each rank busy for its own m·(f+b): the last stage's head and loss outweigh the first's embedding. "
        "'step / 1f1b's': the median step time against 1f1b's at the same m, next to the simulator's makespan ratio "
        "at the measured costs. "
        "On 2 shared CPU cores gloo's p2p copies over local TCP, the send/recv rendezvous waits and the OS "
        "scheduler add idle time the simulator does not model: expect measured ≳ simulated, up to timing noise.")
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_bubble, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
