"""What the health checks cost: tokens/s with straggler and divergence checks at their default intervals vs off.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.health_cost [--models gpt-tiny gpt-125m] [--quick]

Per model: one trainer on --world forked gloo ranks (--parallel's layout), --warmup untimed steps, then two
figures measured in the same run:
- every step's share: --pairs pairs of steps, one with the checks on at their default intervals
  (`health.straggler_every`, `health.divergence_every`) and one with both off, in alternating order; the
  median paired ratio of the slowest rank's step time (the compute-time bookkeeping and, on the steps where it
  falls due, a check: rare, so the median shows the per-step part);
- the checks themselves: --repeats calls of each (collective, every rank together), the slowest rank's median
  seconds, amortised over its interval: check seconds / (interval × step seconds).
The overhead at the defaults is the sum: per-step share + amortised straggler check + amortised divergence check.
(The flight recorder is always on, in both settings.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from hybrid.bench import common
from hybrid.bench.common import launch, table
from hybrid.bench.inputs import add_run_args, bench_trainer, run_overrides
from hybrid.config import HealthConfig
from hybrid.health import HealthMonitor
from hybrid.parallel import collectives as C

MODULE = "hybrid.bench.health_cost"
QUICK = {"models": ["gpt-tiny"], "pairs": 2, "warmup": 1, "repeats": 2, "seq_len": 16, "micro_batch": 1,
         "microbatches": 2}
DEFAULTS = HealthConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 2 pairs")
    add_run_args(p, world=2, warmup=2, seq_len=128, microbatches=2)
    p.add_argument("--pairs", type=int, default=12, help="on/off pairs of steps")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each check")
    return p


def rank_costs(rank: int, world: int, cfg_overrides: list[str], vocab: Optional[int], warmup: int, pairs: int,
               repeats: int) -> dict[str, list[float]]:
    """One rank: step seconds with the checks on and off (alternating), then each check's seconds."""
    trainer = bench_trainer(world, cfg_overrides, vocab)
    off = HealthMonitor(HealthConfig(straggler_every=0, divergence_every=0), trainer.ctx, trainer.model, print)
    on = HealthMonitor(DEFAULTS, trainer.ctx, trainer.model, lambda _: None, getattr(trainer.optimizer, "wait_params",
                                                                                   None))
    for _ in range(warmup):
        trainer.train_step()
    out: dict[str, list[float]] = {"on": [], "off": [], "straggler": [], "divergence": []}
    for k in range(pairs):
        for name, monitor in ((("on", on), ("off", off)) if k % 2 == 0 else (("off", off), ("on", on))):
            trainer.health = monitor
            C.COUNTER.reset()
            out[name].append(trainer.train_step().step_time_s)
    for name, check in (("straggler", on.stragglers), ("divergence", on.divergence)):
        for _ in range(repeats):
            start = time.perf_counter()
            check(trainer.step)
            out[name].append(time.perf_counter() - start)
    return out


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    ranks = launch(rank_costs, args.world, run_overrides(args, model), args.vocab, args.warmup, args.pairs,
                   args.repeats, timeout=3600)

    def slowest(key: str) -> list[float]:
        return [max(r[key][k] for r in ranks) for k in range(len(ranks[0][key]))]

    on, off = slowest("on"), slowest("off")
    step_s = statistics.median(off)
    per_step = statistics.median(a / b for a, b in zip(on, off)) - 1
    straggler, divergence = statistics.median(slowest("straggler")), statistics.median(slowest("divergence"))
    amortised = straggler / (DEFAULTS.straggler_every * step_s) + divergence / (DEFAULTS.divergence_every * step_s)
    return {"model": model, "step_s": step_s, "per_step": per_step, "straggler_s": straggler,
            "divergence_s": divergence, "amortised": amortised, "overhead": per_step + amortised}


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = [measure(args, m) for m in args.models]
    tokens = args.micro_batch * args.microbatches * args.world * args.seq_len  # per step, all ranks
    out("\n".join(table(
        ["model", "tokens/s off", "per-step share (paired)", "straggler check", "divergence check",
         f"amortised (every {DEFAULTS.straggler_every} / {DEFAULTS.divergence_every})", "overhead at defaults"],
        [[r["model"], f"{tokens / r['step_s']:,.0f}", f"{r['per_step'] * 100:+.2f}%",
          f"{r['straggler_s'] * 1e3:.2f} ms", f"{r['divergence_s'] * 1e3:.2f} ms", f"{r['amortised'] * 100:.3f}%",
          f"{r['overhead'] * 100:+.2f}%"]
         for r in rows])))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.models_main(MODULE, build_parser(), argv, QUICK, section)


if __name__ == "__main__":
    sys.exit(main())
