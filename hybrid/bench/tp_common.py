"""What the tensor-parallel benchmarks share: the TP mesh with named groups, and the options, config and real
Trainer of the training runs (throughput and bytes)."""

from __future__ import annotations

import argparse

import torch

from hybrid.bench.common import check_models
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.data import Corpus
from hybrid.model import build_model
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.trainer import Trainer

MB = 2**20


def tp_context(world: int, tp: int) -> ParallelContext:
    """The mesh of `world` ranks with TP size `tp` (dp = world / tp); `build` names its groups for COUNTER."""
    return ParallelContext.build(Layout.create(world, tp=tp))


def add_train_options(p: argparse.ArgumentParser) -> None:
    """The options of the training runs: the model, the vocabulary, the batch, the timeout."""
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: model.vocab_size, else 8192)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")


def check_train_options(p: argparse.ArgumentParser, args: argparse.Namespace, dp: int, tp: int) -> None:
    """Refuse (parser error, exit 2) an unknown model, sizes below 1, a global batch that dp ranks cannot split
    into microbatches, a sequence that `tp` (sequence parallel) cannot split."""
    check_models(p, args.model)
    if min(args.seq, args.micro_batch) < 1:
        p.error("--seq and --micro-batch must be >= 1")
    if args.global_batch % (dp * args.micro_batch) or args.seq % tp:
        p.error(f"--global-batch must divide by {dp}·--micro-batch, --seq by {tp}")


def train_cfg(args: argparse.Namespace, steps: int) -> Config:
    """The composed config of the training runs (fp32 on CPU, no eval)."""
    return compose_config([f"model={args.model}", f"data.seq_len={args.seq}", f"train.steps={steps}",
                           f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
                           "train.eval_every=0", "train.precision=fp32", "train.device=cpu", "parallel.name=bench"])


def make_trainer(cfg: Config, corpus: Corpus, world: int, tp: int, sp: bool) -> Trainer:
    """A real Trainer on the mesh of `world` ranks with TP size `tp` (dp = world / tp)."""
    ctx = tp_context(world, tp)
    model = build_model(cfg.model, corpus.vocab_size, ctx.tp_group, seed=cfg.train.seed, sequence_parallel=sp)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, model, corpus, torch.device("cpu"), hook, state)
