"""Does zb1p fitted to 1F1B's memory (`parallel.zb_memory=1f1b`) stay within 1F1B's largest rank, measured, and
what does it keep of ZB-H1's shorter step?

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.zb_memory [--pp 4] [--microbatches 8] [--vocab 8192]
        [--layers 8] [--seq 128] [--micro-batch 2] [--rounds 6]

On `--pp` gloo ranks the same model parts run one step under each of 1f1b, zb1p as ZB-H1 (`zb_memory=none`) and
zb1p fitted (the default), in alternating rounds (ABC ABC …). Per rank and schedule it prints the measured peak
of the step's CPU allocations (`testing.activations.tracked_peak`: activations, kept gradients, the backward's
transients; parameter gradients exist before, as in training) beside the estimate's activations + buffers
(`hybrid.memory.rank_memory`), and the rank's total = the estimate's exact states (parameters, gradients, AdamW)
+ the measured peak. The job needs its largest rank: the fitted zb1p's should not exceed 1F1B's. Step time:
the median over rounds of each schedule's step wall (slowest rank) over 1F1B's in the same round, beside the
simulator's ratio at the per-microbatch costs measured, averaged over the ranks (equal stages: optimistic where
the last stage's head outweighs the others). A large vocabulary makes the last stage's deferred
weight passes heavy (the logits' gradient): the case the fitting is for.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import pp_common as pc
from hybrid.bench.common import launch, reproduce_command, table, timed
from hybrid.memory import meta_stages, micro_of, rank_memory, training_schedule
from hybrid.parallel.context import pp_streams
from hybrid.parallel.pp.pipeline import P2P, PipelineStats, run_schedule
from hybrid.parallel.pp.simulator import simulate
from hybrid.record.metrics import format_bytes
from hybrid.testing.activations import tracked_peak
from hybrid.trainer import build_chunks

VARIANTS = (("1f1b", "1f1b", "1f1b"), ("zb1p ZB-H1", "zb1p", "none"), ("zb1p fitted", "zb1p", "1f1b"))
"""(label, parallel.schedule, parallel.zb_memory)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.zb_memory", description=__doc__.split("\n\n")[0])
    pc.add_run_options(p, 8, "transformer layers, split over --pp stages")
    p.set_defaults(vocab=8192)
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (gloo processes)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (the first is a warm-up)")
    return p


def configs(args: argparse.Namespace) -> list[Any]:
    gbs = args.micro_batch * args.microbatches
    return [pc.bench_cfg(args, f"model.n_layers={args.layers}", f"parallel.pp={args.pp}", f"parallel.schedule={name}",
                      f"parallel.zb_memory={memory}", f"train.global_batch_size={gbs}") for _, name, memory in VARIANTS]


def rank_run(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any]) -> dict[str, Any]:
    """This rank's measured peak and estimate per variant, and its step walls per round."""
    torch.manual_seed(0)
    ctx = pc.pp_context(cfgs[0], world)
    chunks = build_chunks(cfgs[0], args.vocab, ctx)
    stages = meta_stages(ctx.layout, lambda c: build_chunks(cfgs[0], args.vocab, c))
    step = pc.forward_step(chunks, pc.microbatches(args.vocab, args.microbatches, args.micro_batch, args.seq))
    schedules = [training_schedule(cfg, ctx.layout, stages, micro_of(cfg)) for cfg in cfgs]
    p2p = P2P(ctx.pp_group, (args.micro_batch, args.seq, cfgs[0].model.hidden), torch.float32, pc.CPU,
              pp_streams(ctx, schedules[1].streams))
    out: dict[str, Any] = {"walls": [[] for _ in VARIANTS], "peak": [], "est": [], "labels": [],
                           "forward": [], "backward": [], "input": [], "weight": []}
    out["schedules"] = schedules if rank == 0 else None
    for cfg, schedule in zip(cfgs, schedules):
        est = rank_memory(cfg, stages[ctx.pp_rank], schedule, ctx.pp_rank, 1, micro_of(cfg))
        out["est"].append((est.params + est.grads + est.optimizer, est.activations + est.buffers))
        out["labels"].append(schedule.label)
    for i in range(args.rounds):
        for k, schedule in enumerate(schedules):
            stats = PipelineStats()
            dist.barrier()
            start = time.perf_counter()
            if i == 1:  # gradients exist from round 0 on: the peak is the step's own
                out["peak"].append(tracked_peak(lambda s=schedule, st=stats: run_schedule(s, ctx.pp_rank, step,
                                                                                            p2p, st)))
            else:
                run_schedule(schedule, ctx.pp_rank, step, p2p, stats)
            dist.barrier()
            if i > 1:
                out["walls"][k].append(time.perf_counter() - start)
            if i > 1 and k == 0:
                out["forward"].append(sum(stats.forward_s) / args.microbatches)
                out["backward"].append(sum(stats.backward_s) / args.microbatches)
            if i > 1 and k == 1:
                out["input"].append(sum(stats.backward_s) / args.microbatches)
                out["weight"].append(sum(stats.weight_s) / args.microbatches)
    return out


def report(ranks: list[dict[str, Any]], schedules: list[Any]) -> list[str]:
    lines = [f"schedules: {'; '.join(ranks[0]['labels'])}"]
    rows, largest = [], []
    for k, (label, _, _) in enumerate(VARIANTS):
        totals = [r["est"][k][0] + r["peak"][k] for r in ranks]
        largest.append(max(totals))
        for rank, r in enumerate(ranks):
            rows.append([label, rank, format_bytes(r["peak"][k]), format_bytes(r["est"][k][1]),
                         f"{r['est'][k][1] / r['peak'][k]:.2f}", format_bytes(totals[rank])])
    lines += table(["schedule", "rank", "measured peak", "estimate (act.+buffers)", "est/measured",
                    "total (states + measured)"], rows)
    f = statistics.median(x for r in ranks for x in r["forward"])
    b = statistics.median(x for r in ranks for x in r["backward"])
    i, w = (statistics.median(x for r in ranks for x in r[k]) for k in ("input", "weight"))
    sims = [simulate(s, f, b).makespan if s.name != "zb1p" else simulate(s, f, i + w, weight=w).makespan
            for s in schedules]
    rows = []
    for k, (label, _, _) in enumerate(VARIANTS):
        ratio = statistics.median(a / c for a, c in zip(ranks[0]["walls"][k], ranks[0]["walls"][0]))
        rows.append([label, format_bytes(largest[k]), f"{largest[k] / largest[0]:.3f}", f"{ratio:.3f}",
                     f"{sims[k] / sims[0]:.3f}"])
    lines += ["", f"per microbatch: forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms (weight pass {w * 1e3:.1f} ms)"]
    columns = ["schedule", "largest rank", "vs 1f1b", "step vs 1f1b (median)", "simulated (mean costs)"]
    return lines + table(columns, rows)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Launch the ranks, print the tables; returns each rank's figures (for tests)."""
    cfgs = configs(args)
    ranks = launch(rank_run, args.pp, args, cfgs, timeout=args.timeout)
    for line in report(ranks, ranks[0]["schedules"]):
        out(line)
    return ranks


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    pc.check_run_options(p, args, args.pp)
    if args.pp < 2 or args.microbatches < 1 or args.rounds < 3:
        p.error("--pp >= 2, --microbatches >= 1 and --rounds >= 3")
    module = "hybrid.bench.zb_memory"
    timed(module, reproduce_command(module, p, args), print, lambda: run(args))


if __name__ == "__main__":
    main()
