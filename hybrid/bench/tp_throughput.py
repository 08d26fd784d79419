"""Tensor parallelism on gloo CPU ranks: tokens/s of tp=2 (± sequence parallel) against tp=1·dp=2 on 2 ranks.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.tp_throughput [--rounds 10] [--quick]

2 forked ranks (1 torch thread each), the same model, global batch and data: tp=1 (dp=2), tp=2 (dp=1) and
tp=2+SP, each a real `Trainer`; the three alternate in rounds (ABC CBA …), each round --warmup untimed then
--steps timed steps between barriers. Reported: median step time, tokens/s and the median of the per-round
ratios against tp=1. On a 2-core CPU this measures collective and slicing overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import launch, parse_with_quick
from hybrid.bench.inputs import resolve_vocab, synthetic_corpus
from hybrid.bench.tp_common import add_train_options, check_train_options, make_trainer, train_cfg
from hybrid.data import Corpus

if TYPE_CHECKING:
    from hybrid.config import Config

MODULE = "hybrid.bench.tp_throughput"
VARIANTS = (("tp1·dp2", 1, False), ("tp2", 2, False), ("tp2+SP", 2, True))  # the contenders
QUICK = {"vocab": 512, "seq": 16, "micro_batch": 2, "global_batch": 4, "steps": 1, "warmup": 0, "rounds": 2,
         "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "2 rounds of 1 step of 4 × 16 tokens, vocabulary 512, seconds")
    add_train_options(p)
    p.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds (ABC CBA …)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take about a minute on 2 cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_train_options(p, args, dp=2, tp=2)
    if min(args.steps, args.rounds) < 1:
        p.error("--steps and --rounds must be >= 1")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def throughput_rank(rank: int, world: int, cfg: Config, corpus: Corpus, rounds: int, warmup: int,
                    steps: int) -> dict[str, Any]:
    """Per-round seconds per step and every loss of each VARIANTS contender, alternated ABC CBA …"""
    trainers = {name: make_trainer(cfg, corpus, world, tp, sp) for name, tp, sp in VARIANTS}
    times: dict[str, list[float]] = {n: [] for n in trainers}
    losses: dict[str, list[float]] = {n: [] for n in trainers}
    for i in range(rounds):
        for name in list(trainers) if i % 2 == 0 else list(reversed(trainers)):
            for _ in range(warmup):
                losses[name].append(trainers[name].train_step().loss)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                losses[name].append(trainers[name].train_step().loss)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {"times": times, "losses": losses}


def section_throughput(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """tokens/s of tp=1·dp=2, tp=2 and tp=2+SP on 2 ranks, the same global batch, side by side."""
    cfg = train_cfg(args, args.rounds * (args.warmup + args.steps))
    corpus = synthetic_corpus(resolve_vocab(cfg, args.vocab), args.seq, max(64, 4 * args.global_batch))
    res = launch(throughput_rank, 2, cfg, corpus, args.rounds, args.warmup, args.steps, timeout=args.timeout)[0]
    tokens = args.global_batch * args.seq
    base = res["times"][VARIANTS[0][0]]
    out(f"\n## throughput: {args.model}, 2 ranks × 1 thread, step = {args.global_batch} seqs × {args.seq} tokens "
        f"= {tokens} tokens (micro batch {args.micro_batch}), {args.rounds} rounds × ({args.warmup} warmup + "
        f"{args.steps} timed) steps each")
    out("config  | median s/step | median tok/s | tok/s vs tp1·dp2 (median of rounds) | min..max rounds | "
        "first loss | last loss")
    out("--------|---------------|--------------|-------------------------------------|-----------------|"
        "------------|----------")
    for name, _, _ in VARIANTS:
        t, loss = res["times"][name], res["losses"][name]
        ratios = [b / x for b, x in zip(base, t)]
        out(f"{name:7s} | {statistics.median(t):13.3f} | {tokens / statistics.median(t):12.1f} | "
            f"{statistics.median(ratios):34.3f}× | {min(ratios):.3f}..{max(ratios):.3f}    | "
            f"{loss[0]:10.6f} | {loss[-1]:.6f}")
    out("2 CPU cores: tp=2 halves each rank's matmuls but adds 4 all-reduces of b·s·h per layer and microbatch; "
        "the ratio measures that collective/slicing overhead against dp=2's one gradient all-reduce per step.")
    return res


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns the per-round times and losses (for tests)."""
    return common.run_one(section_throughput, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
