"""What timing every collective costs: tokens/s with `logging.timing` on and off, side by side in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.timing_overhead [--models gpt-tiny gpt-125m] [--quick]

Per model: one trainer on --world forked gloo ranks (--parallel's layout), --warmup untimed steps, then
--pairs pairs of steps, each pair one step with the timer on and one with it off, in alternating order
(on-off, off-on, …) so neither setting always runs first. A step's time is the slowest rank's
`train_step` wall time (the timed step includes resolving its marks and the breakdown's vector; the
record's all-reduce is the logging the run does anyway). The figure is the median over pairs of the
paired ratio on/off; overhead = that ratio − 1 (tokens/s drop). Beside it, the share of a timed step the
breakdown leaves unattributed (`time/other_s` / `time/step_s` of its record, median over the timed steps): the
code between the timed phases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

from hybrid.bench import common
from hybrid.bench.common import launch, table
from hybrid.bench.inputs import add_run_args, bench_trainer, run_overrides
from hybrid.parallel import collectives as C

MODULE = "hybrid.bench.timing_overhead"
QUICK = {"models": ["gpt-tiny"], "pairs": 2, "warmup": 1, "seq_len": 16, "micro_batch": 1, "microbatches": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 2 pairs")
    add_run_args(p, world=2, warmup=2, seq_len=128, microbatches=2)
    p.add_argument("--pairs", type=int, default=12, help="on/off pairs of steps")
    return p


def rank_steps(rank: int, world: int, cfg_overrides: list[str], vocab: Optional[int], warmup: int,
               pairs: int) -> dict[Any, list[float]]:
    """One rank: warm-up, then `pairs` on/off pairs in alternating order; step seconds by setting, and each timed
    step's unattributed share ("other"; its record is collective, so every rank takes it)."""
    trainer = bench_trainer(world, cfg_overrides, vocab)
    for _ in range(warmup):
        trainer.train_step()
    times: dict[Any, list[float]] = {True: [], False: [], "other": []}
    for k in range(pairs):
        for on in ((True, False) if k % 2 == 0 else (False, True)):
            C.COUNTER.reset()
            result = trainer.train_step(timed=on)
            times[on].append(result.step_time_s)
            if on:
                record = trainer.step_metrics(result)
                times["other"].append(record["time/other_s"] / record["time/step_s"])
    return times


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    per_rank = launch(rank_steps, args.world, run_overrides(args, model), args.vocab, args.warmup, args.pairs,
                      timeout=3600)
    on = [max(r[True][k] for r in per_rank) for k in range(args.pairs)]  # the slowest rank sets the step
    off = [max(r[False][k] for r in per_rank) for k in range(args.pairs)]
    ratio = statistics.median(a / b for a, b in zip(on, off))
    return {"model": model, "on_s": statistics.median(on), "off_s": statistics.median(off), "ratio": ratio,
            "other": statistics.median(per_rank[0]["other"])}  # a record's figures: the same on every rank


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = [measure(args, m) for m in args.models]
    tokens = args.micro_batch * args.microbatches * args.world * args.seq_len  # per step, all ranks
    out("\n".join(table(
        ["model", "pairs", "tokens/s off", "tokens/s on", "median paired ratio on/off", "overhead", "unattributed"],
        [[r["model"], args.pairs, f"{tokens / r['off_s']:,.0f}", f"{tokens / r['on_s']:,.0f}", f"{r['ratio']:.4f}",
          f"{(r['ratio'] - 1) * 100:+.2f}%", f"{r['other'] * 100:.1f}%"] for r in rows])))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.models_main(MODULE, build_parser(), argv, QUICK, section)


if __name__ == "__main__":
    sys.exit(main())
