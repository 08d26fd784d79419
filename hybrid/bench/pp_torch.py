"""Pipeline parallelism on gloo CPU ranks: our 1F1B against `torch.distributed.pipelining`'s, step time and grads.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp_torch [--quick]

Our 1F1B vs `torch.distributed.pipelining.Schedule1F1B` on the same stage modules (pp=2 on 2 forked ranks,
untied, loss = mean CE per microbatch / m on both sides, forward+backward only), alternated step by step:
median s/step, median per-pair ratio ours/torch, and the gradients' max difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench import pp_common as pc
from hybrid.bench.common import launch, parse_with_quick
from hybrid.parallel.pp.pipeline import P2P, run_schedule
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.parallel.tp.tensor import vocab_parallel_cross_entropy
from hybrid.trainer import build_chunks

if TYPE_CHECKING:
    from hybrid.config import Config

MODULE = "hybrid.bench.pp_torch"
QUICK = {"vocab": 300, "seq": 16, "micro_batch": 1, "microbatches": 2, "steps": 1, "warmup": 0, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "tiny sizes, one step each, seconds")
    pc.add_run_options(p, layers=4, layers_help="model.n_layers (at least 4)")
    p.add_argument("--microbatches", type=int, default=8, help="m (at least pp = 2)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take about half a minute on 2 idle cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    pc.check_run_options(p, args, min_layers=4)
    if args.steps < 1 or args.microbatches < 2:
        p.error("--steps must be >= 1 and --microbatches >= pp=2")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def torch_rank(rank: int, world: int, args: argparse.Namespace, cfg: Config) -> dict[str, Any]:
    """Alternate our 1F1B and torch's Schedule1F1B on the same stage; seconds per step and the grads' max diff."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    m, b, s = args.microbatches, args.micro_batch, args.seq
    ctx = pc.pp_context(cfg, world)
    module = build_chunks(cfg, args.vocab, ctx)
    mbs = pc.microbatches(args.vocab, m, b, s)
    ours_step, schedule = pc.forward_step(module, mbs), build_schedule("1f1b", world, m)
    p2p = P2P(ctx.pp_group, (b, s, cfg.model.hidden), torch.float32, pc.CPU)
    stage = PipelineStage(module[0], ctx.pp_rank, world, pc.CPU, group=ctx.pp_group)
    pipe = Schedule1F1B(stage, m, loss_fn=lambda y, t: vocab_parallel_cross_entropy(y, t, None, args.vocab) / m,
                        scale_grads=False)
    ids, labels = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
    contenders = {
        "ours": lambda: run_schedule(schedule, ctx.pp_rank, ours_step, p2p),
        "torch": lambda: pipe.step(*([ids] if module[0].pre else []), target=labels if module[0].post else None,
                                   return_outputs=False)}
    grads = {}
    for name, fn in contenders.items():
        module.zero_grad(set_to_none=True)
        fn()
        grads[name] = [p.grad.clone() for p in module.parameters()]
    diff = max(float((a - c).abs().max()) for a, c in zip(grads["ours"], grads["torch"]))
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(args.warmup + args.steps):
        for name in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            module.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            contenders[name]()
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "grad_diff": diff}


def section_torch(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Seconds per forward+backward step of our 1F1B vs torch's, side by side; ratio ours/torch (goal ≤ 1)."""
    cfg = pc.bench_cfg(args, f"model.n_layers={args.layers}", "parallel.pp=2", "model.tie_embeddings=false",
                    f"train.global_batch_size={args.micro_batch * args.microbatches}")
    res = launch(torch_rank, 2, args, cfg, timeout=args.timeout)
    t, diff = res[0]["times"], max(r["grad_diff"] for r in res)
    ratios = [a / c for a, c in zip(t["ours"], t["torch"])]
    row = {"ours": statistics.median(t["ours"]), "torch": statistics.median(t["torch"]),
           "ratio": statistics.median(ratios), "grad_diff": diff}
    out(f"\n## torch: 1F1B, pp=2 on 2 ranks, {args.model} cut to {args.layers} layers, untied, vocab {args.vocab}, "
        f"m={args.microbatches} × {args.micro_batch} × {args.seq} tokens, forward+backward only, ours/torch "
        f"alternated, {args.steps} timed steps each after {args.warmup}")
    out("contender                              | median s/step | min..max")
    out("---------------------------------------|---------------|-------------")
    for name, label in (("ours", "hybrid run_schedule(1f1b)"), ("torch", "torch.distributed.pipelining 1F1B")):
        out(f"{label:38s} | {row[name]:13.3f} | {min(t[name]):.3f}..{max(t[name]):.3f}")
    out(f"ratio ours/torch (median of per-step pairs): {row['ratio']:.3f} (goal ≤ 1.0; pairs "
        f"{min(ratios):.3f}..{max(ratios):.3f})")
    out(f"sanity: gradients of one step, ours vs torch, max |diff| over both stages = {diff:.3g}")
    return row


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns its row (for tests)."""
    return common.run_one(section_torch, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
