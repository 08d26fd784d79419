"""The inputs benchmarks share: a corpus of uniform random tokens, the vocabulary rule of `--vocab`, the options that
shrink a run on the default corpus (`--layers`, `--vocab`, `--max-chars`), and for benchmarks that train a model
per `--models` entry their options, overrides and trainer."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional

import numpy as np

from hybrid.data import Corpus

if TYPE_CHECKING:
    from hybrid.config import Config
    from hybrid.trainer import Trainer


def synthetic_corpus(vocab: int, seq_len: int, n: int, seed: int = 0) -> Corpus:
    """`n` train + 8 eval samples of `seq_len + 1` uniform random tokens in [0, vocab)."""
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, vocab, size=(n + 8, seq_len + 1), dtype=np.int64).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples[:n], eval=samples[n:], seq_len=seq_len)


def resolve_vocab(cfg: Config, override: Optional[int]) -> int:
    """--vocab, else the model's vocab_size, else the default tokenizer's data.vocab_size (8192)."""
    return override or cfg.model.vocab_size or cfg.data.vocab_size


def add_size_options(p: argparse.ArgumentParser) -> None:
    """--layers, --vocab and --max-chars: the model's depth, the BPE vocabulary trained on the default corpus
    and how much of the corpus is read (each default: the config's)."""
    p.add_argument("--layers", type=int, default=None, help="model.n_layers (default: the model's)")
    p.add_argument("--vocab", type=int, default=None, help="data.vocab_size of the BPE trained on the corpus "
                   "(default: the config's)")
    p.add_argument("--max-chars", type=int, default=None, help="data.max_chars: read at most this many characters "
                   "of the corpus (default: all of it)")


def add_train_options(p: argparse.ArgumentParser, global_batch: int) -> None:
    """The training run's own options: --lr, --seq, the size options, --micro-batch, --global-batch, --eval-batches."""
    p.add_argument("--lr", type=float, default=None, help="train.lr (default: the config's)")
    p.add_argument("--seq", type=int, default=64, help="data.seq_len")
    add_size_options(p)
    p.add_argument("--micro-batch", type=int, default=2, help="train.micro_batch_size")
    p.add_argument("--global-batch", type=int, default=global_batch, help="train.global_batch_size")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out global batches of the final eval")


def add_train_shape(p: argparse.ArgumentParser, seq: int, micro_batch: int, global_batch: int) -> None:
    """--seq, the `add_size_options` options, --micro-batch and --global-batch of a benchmark that trains."""
    p.add_argument("--seq", type=int, default=seq, help="data.seq_len")
    add_size_options(p)
    p.add_argument("--micro-batch", type=int, default=micro_batch, help="train.micro_batch_size")
    p.add_argument("--global-batch", type=int, default=global_batch, help="train.global_batch_size")


def size_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of the `add_size_options` options that were given."""
    given = (("model.n_layers", getattr(args, "layers", None)), ("data.vocab_size", getattr(args, "vocab", None)),
             ("data.max_chars", getattr(args, "max_chars", None)))
    return [f"{key}={value}" for key, value in given if value is not None]


def add_run_args(p: argparse.ArgumentParser, world: int, warmup: int, seq_len: int, microbatches: int) -> None:
    """The options of a benchmark that trains one model per `--models` entry on `--world` forked ranks:
    --models, --world, --parallel, --warmup, --seq-len, --micro-batch, --microbatches, --vocab."""
    p.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt-125m"], help="configs/model names")
    p.add_argument("--world", type=int, default=world, help="gloo ranks")
    p.add_argument("--parallel", nargs="*", default=[], help="layout overrides, e.g. parallel.tp=2 (default: dp)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=microbatches, help="microbatches per rank per step")
    p.add_argument("--vocab", type=int, default=None, help="default: the model's, else 8192")


def run_overrides(args: argparse.Namespace, model: str) -> list[str]:
    """`model` trained as `add_run_args` says (dp = --world; --parallel overrides adjust it through validate).
    Composed here once (`compose_config` keeps it), so that the ranks forked next inherit the composed config
    instead of each composing it again."""
    from hybrid.config import compose_config

    overrides = [f"model={model}", f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.global_batch_size={args.micro_batch * args.microbatches * args.world}", "train.eval_every=0",
                 "parallel.name=bench", *args.parallel]
    compose_config(overrides)
    return overrides


def bench_trainer(world: int, cfg_overrides: list[str], vocab: Optional[int]) -> Trainer:
    """On a forked rank: the Trainer of `cfg_overrides` on `world` ranks over a synthetic corpus (CPU)."""
    import torch

    from hybrid.compression.hooks import make_hook
    from hybrid.config import compose_config
    from hybrid.parallel.context import Layout, ParallelContext
    from hybrid.trainer import Trainer, build_chunks

    cfg = compose_config(cfg_overrides)
    p = cfg.parallel
    ctx = ParallelContext.build(Layout.create(world, tp=p.tp, pp=p.pp)) if world > 1 else ParallelContext.single()
    corpus = synthetic_corpus(resolve_vocab(cfg, vocab), cfg.data.seq_len, 256)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, torch.device("cpu"), hook, state)
