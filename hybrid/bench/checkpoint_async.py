"""Sharded checkpoints on gloo CPU ranks: what an async save costs the training steps, against a sync save.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.checkpoint_async [--quick]

Checkpoints are written under one temporary folder on local disk (--dir, default the system's temp dir), removed
at the end. --model at --layout (tp2pp2dp2: 8 ranks), a real Trainer with `checkpoint.async=true` and a second,
sync Checkpointer on the same Trainer. --warmup untimed steps, then --rounds rounds of: --steps steps with no
save; a sync save (its blocking seconds); an async save (its blocking part: the manifest, a barrier, the
Checkpointer's `Stager` copying the state into its CPU buffers, timed on its own, and the start of DCP's
background write) followed at once by --steps steps while the write runs in a background thread, then `wait()`.
The Stager keeps its buffers across saves: round 0's async save allocates them, later rounds copy into them.
Step seconds are the slowest rank's; the in-flight window runs from the end of the blocking part to the last
rank's completion; the overlap is the share of that window the steps covered.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.checkpoint_common import (
    CPU,
    MIB,
    add_run_options,
    bench_cfg,
    check_run_options,
    make_trainer,
    preload_dcp,
    scratch,
    world,
)
from hybrid.bench.common import launch, parse_with_quick, table
from hybrid.bench.inputs import resolve_vocab
from hybrid.bench.memory import MemoryWatch
from hybrid.checkpoint import Checkpointer, Stager
from hybrid.config import Config
from hybrid.model import analytic_param_count
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer
from hybrid.validation import validate

MODULE = "hybrid.bench.checkpoint_async"
QUICK = {"model": "gpt-tiny", "vocab": 512, "seq": 16, "micro_batch": 1, "global_batch": 4, "steps": 1, "warmup": 0,
         "rounds": 1, "timeout": 300.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny with a 512-token vocabulary, one round of one step each, seconds")
    add_run_options(p, model="gpt-125m", timeout=1800.0)
    p.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the first round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (plain steps, sync save, async save + steps)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_run_options(p, args)
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def timed_steps(trainer: Trainer, n: int) -> list[tuple[float, float]]:
    """(start, end) perf_counter of each of `n` train steps (CLOCK_MONOTONIC: comparable across the ranks)."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.train_step()
        out.append((start, time.perf_counter()))
    return out


class TimedStager(Stager):
    """The Checkpointer's Stager, recording each staging copy's (start, end) perf_counter."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[float, float]] = []

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        staged = super().stage(state)
        self.calls.append((start, time.perf_counter()))
        return staged

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def async_rank(rank: int, world_size: int, cfg: Config, sync_cfg: Config, vocab: int, steps: int, warmup: int,
               rounds: int) -> dict[str, Any]:
    """Per round: plain steps, a sync save (blocking seconds), an async save (blocking seconds, and its staging
    copy's within them) then steps while it is in flight. The async Checkpointer's Stager lives for the whole
    run: the first async save allocates its CPU buffers, the later ones copy into them."""
    ctx = ParallelContext.build(validate(cfg, world_size, world_size))
    trainer = make_trainer(cfg, ctx, vocab)  # checkpoint.async=true: its own gloo group, a background thread
    stager = trainer.checkpointer.stager = TimedStager()
    sync = Checkpointer(sync_cfg, ctx, CPU, trainer.checkpoint_states())
    timed_steps(trainer, warmup)
    out = []
    for _ in range(rounds):
        dist.barrier()
        plain = timed_steps(trainer, steps)
        dist.barrier()
        start = time.perf_counter()
        sync.save()
        sync_end = time.perf_counter()
        dist.barrier()
        start_async = time.perf_counter()
        trainer.checkpointer.save()
        staged = time.perf_counter()
        done, noted = [], threading.Event()  # the save's end, noted by its future's callback
        trainer.checkpointer.pending[0].add_done_callback(lambda _, d=done, e=noted: (d.append(time.perf_counter()),
                                                                                    e.set()))
        flight = timed_steps(trainer, steps)
        trainer.checkpointer.wait()
        waited = time.perf_counter()
        noted.wait(60)  # callbacks run after the result is set: `wait` may return before this one has
        out.append({"plain": plain, "sync": (start, sync_end), "async": (start_async, staged, done[0], waited),
                    "copy": stager.calls[-1], "flight": flight})
    assert len(stager.calls) == rounds
    return {"rounds": out, "staging_bytes": stager.bytes()}


def step_seconds(ranks: list[list[tuple[float, float]]]) -> list[float]:
    """Each step's seconds: the slowest rank's."""
    return [max(r[k][1] - r[k][0] for r in ranks) for k in range(len(ranks[0]))]


def async_round(results: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """Round `i`'s figures over the ranks (one monotonic clock: times compare across ranks)."""
    rs = [r[i] for r in results]
    start = min(r["async"][0] for r in rs)
    staged = max(r["async"][1] for r in rs)
    done = max(r["async"][2] for r in rs)
    flight = [r["flight"] for r in rs]
    steps_start, steps_end = min(f[0][0] for f in flight), max(f[-1][1] for f in flight)
    window = max(done - staged, 1e-9)
    covered = max(0.0, min(done, steps_end) - max(staged, steps_start))
    in_flight = [k for k in range(len(flight[0])) if min(f[k][0] for f in flight) < done]
    flight_s = step_seconds(flight)
    return {"plain": step_seconds([r["plain"] for r in rs]), "flight": flight_s,
            "in_flight": [flight_s[k] for k in in_flight], "sync_s": max(r["sync"][1] - r["sync"][0] for r in rs),
            "block_s": staged - start, "copy_s": max(r["copy"][1] - r["copy"][0] for r in rs),
            "window_s": done - staged, "async_total_s": done - start,
            "overlap": covered / window, "wait_s": max(r["async"][3] for r in rs) - steps_end}


def summarise(rounds: list[dict[str, Any]], staging_bytes: int) -> dict[str, Any]:
    """Means over the rounds; the first save (it allocates the Stager's buffers) apart from the later ones."""
    later = rounds[1:] or rounds  # buffers reused (round 0 allocates them)
    return {"plain_s": statistics.mean(s for r in rounds for s in r["plain"]),
            "flight_s": statistics.mean(s for r in rounds for s in r["flight"]),
            "in_flight_s": statistics.mean(s for r in rounds for s in r["in_flight"]),
            "sync_s": statistics.mean(r["sync_s"] for r in rounds),
            "block_s": statistics.mean(r["block_s"] for r in rounds),
            "copy_s": statistics.mean(r["copy_s"] for r in rounds),
            "first_block_s": rounds[0]["block_s"], "first_copy_s": rounds[0]["copy_s"],
            "reused_block_s": statistics.mean(r["block_s"] for r in later),
            "reused_copy_s": statistics.mean(r["copy_s"] for r in later),
            "reused_sync_s": statistics.mean(r["sync_s"] for r in later),
            "window_s": statistics.mean(r["window_s"] for r in rounds),
            "overlap": statistics.mean(r["overlap"] for r in rounds), "staging_bytes": staging_bytes,
            "later": len(later)}


def print_rounds(rounds: list[dict[str, Any]], out: Callable[[str], None]) -> None:
    """One table row per round."""
    body = []
    for i, r in enumerate(rounds):
        body.append([str(i), f"{statistics.mean(r['plain']):.3f}", f"{statistics.mean(r['flight']):.3f}",
                     f"{statistics.mean(r['in_flight']):.3f} ({len(r['in_flight'])})",
                     f"{statistics.mean(r['flight']) / statistics.mean(r['plain']):.2f}×",
                     f"{r['sync_s']:.2f}", f"{r['block_s']:.2f}", f"{r['copy_s']:.2f}",
                     f"{r['block_s'] / r['sync_s']:.2f}×",
                     f"{r['window_s']:.2f}", f"{r['overlap']:.0%}", f"{r['wait_s']:.2f}"])
    for line in table(["round", "step s, no save", "step s, after async save", "step s, in flight (steps)",
                       "ratio after / none", "sync save s", "async blocking s", "of which staging copy s",
                       "blocking async / sync", "in-flight window s", "window overlapped by steps",
                       "wait() after steps s"], body):
        out(line)


def section_async(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Step seconds while an async save is in flight vs none; async blocking part vs a sync save."""
    with scratch(args.dir) as folder:
        cfg = bench_cfg(args, args.model, args.layout, folder, "async", "checkpoint.async=true")
        sync_cfg = bench_cfg(args, args.model, args.layout, folder, "sync")
        vocab = resolve_vocab(cfg, args.vocab)
        preload_dcp()
        with MemoryWatch() as watch:
            results = launch(async_rank, world(args.layout), cfg, sync_cfg, vocab, args.steps, args.warmup,
                             args.rounds, timeout=args.timeout)
    rounds = [async_round([r["rounds"] for r in results], i) for i in range(args.rounds)]
    n = analytic_param_count(cfg.model, vocab, cfg.parallel.tp)
    summary = summarise(rounds, sum(r["staging_bytes"] for r in results))
    staging_bytes, tokens = summary["staging_bytes"], args.global_batch * args.seq
    out(f"\n## async: {args.model} (N = {n:,}, checkpoint {12 * n / MIB:,.0f} MiB) at {args.layout} "
        f"on {world(args.layout)} ranks, "
        f"{args.global_batch} × {args.seq} tokens per step, {args.rounds} round(s) of {args.steps} steps with no save, "
        f"a sync save, then an async save followed at once by {args.steps} steps. Step seconds: the slowest rank. "
        f"Async blocking: manifest + barrier + the Checkpointer's staging copy (timed alone: slowest rank) + the "
        f"start of DCP's write; round 0's copy allocates the Stager's buffers, later rounds reuse them.")
    print_rounds(rounds, out)
    out(f"mean over rounds: step {summary['plain_s']:.3f} s with no save ({tokens / summary['plain_s']:.0f} tok/s), "
        f"{summary['flight_s']:.3f} s in the {args.steps} steps after an async save "
        f"(**{summary['flight_s'] / summary['plain_s']:.2f}×**), {summary['in_flight_s']:.3f} s for the steps started "
        f"while it was in flight (**{summary['in_flight_s'] / summary['plain_s']:.2f}×**); blocking: sync save "
        f"{summary['sync_s']:.2f} s, async {summary['block_s']:.2f} s "
        f"(**{summary['block_s'] / summary['sync_s']:.2f}×**), of which the staging copy {summary['copy_s']:.2f} s; "
        f"the write ran {summary['window_s']:.2f} s in the background, {summary['overlap']:.0%} of it overlapped by "
        f"steps. Memory: {watch.line()}.")
    reused = (f"later saves (buffers reused, mean of {summary['later']}): {summary['reused_block_s']:.2f} s, copy "
              f"{summary['reused_copy_s']:.2f} s (**{summary['reused_block_s'] / summary['reused_sync_s']:.2f}×** "
              f"their sync saves' {summary['reused_sync_s']:.2f} s)" if len(rounds) > 1
              else "no later save (one round): none reused the buffers")
    out(f"async blocking, first save (allocates the buffers): {summary['first_block_s']:.2f} s, copy "
        f"{summary['first_copy_s']:.2f} s; {reused}. The Stager holds {staging_bytes / MIB:,.0f} MiB of CPU "
        f"buffers over the ranks for the whole run ({staging_bytes / (12 * n):.2f}× the checkpoint's 12·N: every "
        f"rank stages its whole state dict, DP replicas and TP-replicated tensors included).")
    return {"rounds": rounds, "n": n, **summary}


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns its figures (for tests)."""
    return common.run_one(section_async, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
