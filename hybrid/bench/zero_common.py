"""What the ZeRO benchmarks share: the model, ranks and batches they run, and the synthetic corpus."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from hybrid.bench import common
from hybrid.data import Corpus

VOCAB = 8192


def add_shape(p: argparse.ArgumentParser, steps: int) -> None:
    """--model (cut to --layers layers) on --dp ranks, --batch × --seq tokens each; --rounds × --steps timed
    steps; --timeout per set of ranks."""
    p.add_argument("--model", default="gpt-125m", help="a configs/model name")
    p.add_argument("--layers", type=int, default=0, help="layers of the model (0: the config's)")
    p.add_argument("--dp", type=int, default=4, help="DP ranks (ZeRO-3 over them)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch and rank")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the sides alternating")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per side per round")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: dict[str, Any]) -> argparse.Namespace:
    """`argv` through `p` (with `--quick`'s values as defaults), the model checked, the sizes in range."""
    args = common.parse_with_quick(p, argv, quick)
    common.check_models(p, args.model)
    if args.dp < 2 or min(args.seq, args.batch, args.rounds, args.steps) < 1 or args.layers < 0:
        p.error("--dp must be >= 2; --seq, --batch, --rounds, --steps >= 1; --layers >= 0")
    return args


def shape_label(args: argparse.Namespace) -> str:
    return (f"{args.model}{f' cut to {args.layers} layers' if args.layers else ''}, dp={args.dp}, "
            f"{args.batch} × {args.seq} tokens per rank, fp32")


def corpus(seq: int, n: int = 64) -> Corpus:
    samples = np.random.default_rng(0).integers(0, VOCAB, size=(n, seq + 1)).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=VOCAB, eos_id=0, train=samples, eval=samples[:2], seq_len=seq)
