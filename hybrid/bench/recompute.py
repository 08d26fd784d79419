"""What activation recomputation costs in step time and saves in memory, side by side in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.recompute [--models gpt-125m] [--world 1] [--quick]

Per model: one trainer on --world forked gloo ranks (--parallel's layout), --warmup untimed steps, then
--rounds rounds of one step under each of `train.recompute=none|selective|full`, the order rotated every
round (none-selective-full, selective-full-none, …) so no mode always runs first; the model's blocks switch
mode between steps (`set_recompute`), weights and data carry on. A step's time is the slowest rank's
`train_step` wall time; the figure per mode is the median over rounds of the paired ratio to `none` in the
same round. Memory: what autograd keeps for one microbatch on rank 0 (the saved-tensor tally, layers and
ends) and `hybrid.memory`'s estimate of it. Expected cost: full reruns each block's forward (about a third
more compute in the layers); selective reruns only the attention core and the MLP activation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import launch, table
from hybrid.bench.inputs import add_run_args, bench_trainer, run_overrides
from hybrid.memory import loss_columns
from hybrid.memory_terms import Micro, ends_bytes, layer_activation_bytes
from hybrid.testing.activations import saved_tally
from hybrid.trainer import Trainer

MODULE = "hybrid.bench.recompute"
MODES = ("none", "selective", "full")
QUICK = {"models": ["gpt-tiny"], "rounds": 1, "warmup": 1, "seq_len": 16, "micro_batch": 1, "microbatches": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 1 round")
    add_run_args(p, world=1, warmup=1, seq_len=256, microbatches=1)
    p.add_argument("--rounds", type=int, default=6, help="rounds of one step per mode")
    return p


def kept(trainer: Trainer, mode: str) -> tuple[int, int]:
    """(tallied, estimated) bytes one microbatch's forward keeps on this rank's model (one stage) under `mode`."""
    chunk, cfg = trainer.model[0], trainer.cfg
    chunk.set_recompute(mode)
    ids = torch.as_tensor(trainer.corpus.train[: cfg.train.micro_batch_size]).long()
    with saved_tally(chunk) as seen:
        chunk(ids[:, :-1], ids[:, 1:])
    m = Micro(ids.shape[0], ids.shape[1] - 1, trainer.ctx.tp_size, cfg.parallel.sequence_parallel, cfg.model.dropout,
              mode)
    est = len(chunk.layers) * layer_activation_bytes(cfg.model, m)
    est += ends_bytes(cfg.model, m, loss_columns(chunk, trainer.ctx.tp_size), chunk.pre, chunk.post)
    return sum(n for _, n in seen.values()), est


def rank_steps(rank: int, world: int, cfg_overrides: list[str], vocab: Optional[int], warmup: int,
               rounds: int) -> dict[str, Any]:
    """One rank: warm-up, then `rounds` rotated rounds of one step per mode; step seconds and kept bytes."""
    trainer = bench_trainer(world, cfg_overrides, vocab)
    for _ in range(warmup):
        trainer.train_step()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for k in range(rounds):
        for mode in MODES[k % 3:] + MODES[: k % 3]:
            for chunk in trainer.model:
                chunk.set_recompute(mode)
            times[mode].append(trainer.train_step().step_time_s)
    return {"times": times, "kept": {m: kept(trainer, m) for m in MODES} if trainer.ctx.pp_size == 1 else {}}


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    per_rank = launch(rank_steps, args.world, run_overrides(args, model), args.vocab, args.warmup, args.rounds,
                      timeout=3600)
    slowest = {m: [max(r["times"][m][k] for r in per_rank) for k in range(args.rounds)] for m in MODES}
    ratio = {m: statistics.median(a / b for a, b in zip(slowest[m], slowest["none"])) for m in MODES}
    return {"model": model, "step_s": {m: statistics.median(v) for m, v in slowest.items()}, "ratio": ratio,
            "kept": per_rank[0]["kept"]}


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = [measure(args, m) for m in args.models]
    out("\n".join(table(
        ["model", "recompute", "rounds", "step s (median)", "paired ratio to none", "kept MiB (tally)",
         "kept MiB (estimate)"],
        [[r["model"], m, args.rounds, f"{r['step_s'][m]:.3f}", f"{r['ratio'][m]:.3f}×",
          *(f"{b / 2**20:,.2f}" for b in r["kept"].get(m, (float("nan"), float("nan"))))]
         for r in rows for m in MODES])))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.models_main(MODULE, build_parser(), argv, QUICK, section)


if __name__ == "__main__":
    sys.exit(main())
