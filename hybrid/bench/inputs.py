"""The inputs benchmarks share: a corpus of uniform random tokens and the vocabulary rule of `--vocab`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from hybrid.data import Corpus

if TYPE_CHECKING:
    from hybrid.config import Config


def synthetic_corpus(vocab: int, seq_len: int, n: int, seed: int = 0) -> Corpus:
    """`n` train + 8 eval samples of `seq_len + 1` uniform random tokens in [0, vocab)."""
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, vocab, size=(n + 8, seq_len + 1), dtype=np.int64).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples[:n], eval=samples[n:], seq_len=seq_len)


def resolve_vocab(cfg: Config, override: Optional[int]) -> int:
    """--vocab, else the model's vocab_size, else the default tokenizer's data.vocab_size (8192)."""
    return override or cfg.model.vocab_size or cfg.data.vocab_size
