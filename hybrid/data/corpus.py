"""`prepare_data`: a `DataConfig` in, a packed `Corpus` out.

Documents (any source of `hybrid.data.sources`) are tokenized once into the cache (`hybrid.data.cache`,
built by `hybrid.data.build`); a token file (.bin/.npy) is used in place. Either way the stream is a
read-only memmap packed into samples of `seq_len + 1` tokens by a zero-copy view, so `seq_len` and
`eval_fraction` changes reuse the entry. Which samples a step reads is `hybrid.sampler`'s concern.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from hybrid.config import ConfigError
from hybrid.data.build import build_stream
from hybrid.data.cache import build_once, cache_key, cache_root
from hybrid.data.sources import Source, cfg_path, resolve_source
from hybrid.data.tokenize import SavedTokenizer, load_tokenizer, resolve_tokenizer
from hybrid.data.tokens import id_range, is_token_file, open_tokens

if TYPE_CHECKING:
    from hybrid.config import DataConfig

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    """A tokenized corpus packed into samples of `seq_len + 1` tokens (inputs = s[:-1], labels = s[1:])."""

    tokenizer: Any  # transformers.PreTrainedTokenizerFast (a SavedTokenizer: loaded on first use); None for a
    # token file without data.tokenizer
    vocab_size: int  # len(tokenizer); for a token file without one, the largest id + 1
    eos_id: Optional[int]  # the document separator (None: a token file's own business)
    train: np.ndarray  # [n_train, seq_len + 1], a read-only memmap view
    eval: np.ndarray  # [n_eval, seq_len + 1], the last samples of the stream
    seq_len: int
    meta: dict = field(default_factory=dict)  # chars, docs, tokens, build_s, cache path


def prepare_data(cfg: DataConfig, init_from: Optional[str] = None) -> Corpus:
    """Load (or build once, under a lock, and cache) the corpus described by a `DataConfig`.

    `init_from` is `model.init_from`: with `data.tokenizer` unset, the tokenizer saved in that folder
    (if any) encodes the corpus, so a fine-tune reads ids its model knows.
    """
    tokenizer_dir = resolve_tokenizer(cfg.tokenizer, init_from)
    path = None if cfg.dataset is not None else cfg_path(cfg)
    if is_token_file(path):
        return _token_file_corpus(cfg, str(path), tokenizer_dir)
    source = resolve_source(cfg)
    root = cache_root(cfg)
    entry = root / f"corpus-{cache_key(cfg, source.key, tokenizer_dir)}"
    build_once(entry, functools.partial(_build, cfg, source, tokenizer_dir, entry), tokenizer_dir is None)
    return _load(cfg, entry, tokenizer_dir)


def _build(cfg: DataConfig, source: Source, tokenizer_dir: Optional[str], entry: Path, out: Path) -> dict[str, object]:
    """Build `entry`'s files into `out`, its private folder (called under the lock)."""
    log.info("building the data cache for %s in %s", source.where, entry)
    meta = build_stream(source, cfg, tokenizer_dir, entry.parent / "hf_datasets", out)
    log.info("data cache built in %.1f s: %d docs, %d chars, %d tokens", meta["build_s"], meta["docs"],
             meta["chars"], meta["tokens"])
    return meta


def _load(cfg: DataConfig, entry: Path, tokenizer_dir: Optional[str]) -> Corpus:
    """Open a valid cache entry and pack its token stream."""
    meta = {**json.loads((entry / "meta.json").read_text()), "cache": str(entry)}
    tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    if tokenizer_dir is None and "vocab_size" in meta:  # the entry's own tokenizer: loaded when first used
        return _pack(cfg, tokens, SavedTokenizer(entry / "tokenizer"), int(meta["vocab_size"]), int(meta["eos_id"]),
                     meta)
    tokenizer = load_tokenizer(entry / "tokenizer" if tokenizer_dir is None else Path(tokenizer_dir))
    return _pack(cfg, tokens, tokenizer, len(tokenizer), int(tokenizer.eos_token_id), meta)


def _token_file_corpus(cfg: DataConfig, path: str, tokenizer_dir: Optional[str]) -> Corpus:
    """A pre-tokenized stream, in place; its ids checked against the tokenizer, when there is one."""
    tokens = open_tokens(path, cfg.token_dtype)
    if cfg.max_tokens is not None:
        tokens = tokens[: int(cfg.max_tokens)]
    lo, hi = id_range(tokens)
    if lo < 0:
        raise ConfigError(f"data.path={path} holds a negative token id ({lo})")
    tokenizer = None if tokenizer_dir is None else load_tokenizer(Path(tokenizer_dir))
    if tokenizer is not None and hi >= len(tokenizer):
        raise ConfigError(f"data.path={path} holds token id {hi}, beyond the {len(tokenizer)} tokens of "
                          f"tokenizer {tokenizer_dir}")
    meta = {"source": f"data.path={path}", "tokens": int(tokens.size), "dtype": str(tokens.dtype), "max_id": hi,
            "cache": None}
    vocab = hi + 1 if tokenizer is None else len(tokenizer)
    eos = None if tokenizer is None else int(tokenizer.eos_token_id)
    return _pack(cfg, tokens, tokenizer, vocab, eos, meta)


def _pack(cfg: DataConfig, tokens: np.ndarray, tokenizer: Any, vocab: int, eos: Optional[int],
          meta: dict) -> Corpus:
    """Train/eval views of `tokens` cut into samples of seq_len + 1 (the last samples are eval)."""
    width = int(cfg.seq_len) + 1
    n = tokens.size // width
    if n < 2:
        raise ConfigError(f"corpus too small: {tokens.size} tokens make {n} < 2 samples of seq_len+1={width}")
    n_eval = min(n - 1, max(1, int(n * float(cfg.eval_fraction))))
    samples = tokens[: n * width].reshape(n, width)
    return Corpus(tokenizer=tokenizer, vocab_size=vocab, eos_id=eos, train=samples[: n - n_eval],
                  eval=samples[n - n_eval:], seq_len=int(cfg.seq_len), meta=meta)
