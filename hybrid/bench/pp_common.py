"""What the pipeline benchmarks share: the options of the in-process runs, their config, the mesh, random
microbatches and the executor's forward step."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Optional

import torch

from hybrid.bench.common import check_models
from hybrid.config import Config, compose_config
from hybrid.parallel.context import ParallelContext
from hybrid.validation import validate

CPU = torch.device("cpu")


def add_run_options(p: argparse.ArgumentParser, layers: int, layers_help: str) -> None:
    """The options of every in-process pipeline benchmark: the model, its size, the microbatch, the timeout."""
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--layers", type=int, default=layers, help=layers_help)
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (small: keeps the head cheaper than a layer)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")


def check_run_options(p: argparse.ArgumentParser, args: argparse.Namespace, min_layers: int) -> None:
    """Refuse (parser error, exit 2) an unknown model, sizes below 1, fewer layers than pp·v parts, an odd --seq."""
    check_models(p, args.model)
    if min(args.seq, args.micro_batch) < 1 or args.layers < min_layers or args.seq % 2:
        p.error(f"sizes must be >= 1, --layers >= {min_layers} (pp·v parts), --seq even (SP)")


def bench_cfg(args: argparse.Namespace, *overrides: str) -> Config:
    """The composed config of the in-process runs (fp32 on CPU, no eval), plus `overrides`."""
    return compose_config([f"model={args.model}", f"model.vocab_size={args.vocab}", f"data.seq_len={args.seq}",
                           f"train.micro_batch_size={args.micro_batch}", "train.eval_every=0", "parallel.name=bench",
                           "train.precision=fp32", "train.device=cpu", *overrides])


def pp_context(cfg: Config, world: int) -> ParallelContext:
    """The mesh `cfg.parallel` asks for on `world` ranks (its groups named for COUNTER by `build`)."""
    return ParallelContext.build(validate(cfg, world, world))


def microbatches(vocab: int, m: int, b: int, s: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`m` (ids, labels) pairs of [b, s] uniform random tokens (labels = ids shifted by one)."""
    ids = torch.randint(0, vocab, (m, b, s + 1), generator=torch.Generator().manual_seed(seed))
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def forward_step(chunks: torch.nn.ModuleList, mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """The executor's forward step: ids into the first part, hidden states between, the mean loss out."""
    def step(chunk: int, mb: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        module = chunks[chunk]
        ids, labels = mbs[mb]
        return module(ids if module.pre else x, labels if module.post else None)
    return step
