"""What each `train.precision` costs per step on this device, one process, side by side.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.precision [--model gpt-tiny] [--device cpu|cuda]
        [--precisions fp32 bf16 bf16_params] [--seq-len 64] [--micro-batch 2] [--steps 1] [--rounds 4]

One Trainer per precision, all from the same weights and data; rounds alternate their order (ABC, CBA, …) and
each round times `--steps` steps after one untimed step per side. Prints each precision's median step time,
its paired per-round ratio to the first precision, and its loss after the last round beside the first's (the
three runs train the same model: their losses must stay close).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Optional

import torch

from hybrid.bench.step_vs_hf import Side, synthetic_corpus
from hybrid.compression.hooks import make_hook
from hybrid.config import compose_config
from hybrid.model import build_model
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer
from hybrid.validation import validate


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-tiny", help="a configs/model name")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "bf16_params"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def trainer_for(args: argparse.Namespace, precision: str) -> Trainer:
    """A one-process Trainer of `args.model` in `precision` over a synthetic corpus (seeded: every precision
    starts from the same weights and reads the same samples)."""
    steps = args.rounds * (args.steps + 1)
    cfg = compose_config([f"model={args.model}", "parallel=single", f"data.seq_len={args.seq_len}",
                          f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch}",
                          f"train.steps={steps}", "train.eval_every=0", f"train.precision={precision}",
                          f"train.device={args.device}"])
    validate(cfg, world_size=1)
    vocab = cfg.model.vocab_size or 8192
    ctx, device = ParallelContext.single(), torch.device(args.device)
    model = build_model(cfg.model, vocab, ctx.tp_group, seed=cfg.train.seed).to(device)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, model, synthetic_corpus(vocab, args.seq_len, 64, 0), device, hook, state)


def run(args: argparse.Namespace) -> list[dict[str, float | str]]:
    """Time every precision in alternating rounds; one row per precision."""
    sides = [Side(p, lambda t=trainer_for(args, p): t.train_step().loss) for p in args.precisions]
    tokens = args.micro_batch * args.seq_len
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else reversed(sides):
            side.round(1, args.steps, tokens)
    rows = []
    for side in sides:
        ratios = [b / a for a, b in zip(side.rates, sides[0].rates)]  # step time / the first's, paired
        rows.append({"precision": side.name, "step_s": tokens / statistics.median(side.rates),
                     "ratio": statistics.median(ratios), "loss": side.losses[-1]})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"model={args.model} device={args.device} micro batch {args.micro_batch} × {args.seq_len} tokens, "
          f"{args.rounds} rounds × {args.steps} step(s)")
    print(f"{'precision':<12} {'step s':>8} {'× ' + rows[0]['precision']:>10} {'last loss':>10}")
    for r in rows:
        print(f"{r['precision']:<12} {r['step_s']:>8.3f} {r['ratio']:>10.2f} {r['loss']:>10.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
