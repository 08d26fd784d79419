"""Data: corpus loading, tokenizer, packing and the token cache.

`prepare_data(cfg.data)` reads documents (the embedded default corpus = this Python's stdlib sources and
pydoc docs, or local .txt/.jsonl/.json/.parquet files via `datasets`), gets a tokenizer (a local
`transformers` folder, or a byte-level BPE trained on the corpus), and caches the token stream (EOS after
each document) under a key hashing everything that determines it. One process builds under a file lock;
an entry appears only by an atomic rename. Packing into `seq_len + 1` samples is a zero-copy view, so
`seq_len`/`eval_fraction` changes reuse the entry. Which samples a step reads is `hybrid.sampler`'s concern.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import numpy as np

from hybrid.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
_FORMAT = 1  # bump when the cache layout or the build changes
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
_ENCODE_BATCH = 256


@dataclass
class Corpus:
    """A tokenized corpus packed into samples of `seq_len + 1` tokens (inputs = s[:-1], labels = s[1:])."""

    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    vocab_size: int  # len(tokenizer)
    eos_id: int
    train: np.ndarray  # [n_train, seq_len + 1], a read-only memmap view
    eval: np.ndarray  # [n_eval, seq_len + 1], the last samples of the stream
    seq_len: int
    meta: dict = field(default_factory=dict)  # chars, docs, tokens, build_s, cache path


def prepare_data(cfg: DataConfig) -> Corpus:
    """Load (or build once, under a lock, and cache) the corpus described by a `DataConfig`."""
    path = _cfg_path(cfg)
    files = _source_files(path)
    root = Path(cfg.cache_dir or os.environ.get("HYBRID_CACHE") or Path.home() / ".cache" / "hybrid").expanduser()
    entry = root / f"corpus-{_cache_key(cfg, path, files)}"
    if not _is_valid(entry):
        from filelock import FileLock

        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(entry) + ".lock"):
            if not _is_valid(entry):
                _build(cfg, path, files, entry)
    return _load(cfg, entry)


def _cfg_path(cfg: DataConfig) -> Optional[str]:
    from omegaconf import OmegaConf

    if (OmegaConf.is_config(cfg) and OmegaConf.is_missing(cfg, "path")) or cfg.path == "???":
        raise ConfigError("data.path is required for this data config (data.path=<file or folder>)")
    return None if cfg.path is None else str(cfg.path)


def _stdlib_files() -> list[Path]:
    """The standard library's .py sources (incl. pydoc_data/topics.py), tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        files += [Path(d, n) for n in sorted(names) if n.endswith(".py") and not n.startswith("_sysconfigdata")]
    return files


def _source_files(path: Optional[str]) -> list[Path]:
    """The files to read, in a deterministic order; ConfigError for missing paths and unknown extensions."""
    if path is None:
        return _stdlib_files()
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ConfigError(f"data.path={path} does not exist")
    files = [p] if p.is_file() else sorted(
        f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
    for f in files:
        if f.suffix.lower() not in _BUILDERS:
            raise ConfigError(f"data file {f} has an unsupported extension (use {', '.join(_BUILDERS)})")
    if not any(f.stat().st_size for f in files):
        raise ConfigError(f"data.path={path}: no text found (empty corpus)")
    return [f for f in files if f.stat().st_size]


def _fingerprint(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    return [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def _cache_key(cfg: DataConfig, path: Optional[str], files: list[Path]) -> str:
    """Hash of everything that determines the tokenizer and the token stream (not seq_len: packing is a view)."""
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer={cfg.tokenizer} is not a directory")
    tok_dir = Path(cfg.tokenizer or ".").resolve()
    tok = ("bpe", int(cfg.vocab_size)) if cfg.tokenizer is None else (
        str(tok_dir), _fingerprint(sorted(f for f in tok_dir.rglob("*") if f.is_file())))
    key = {"format": _FORMAT, "python": sys.version if path is None else None, "files": _fingerprint(files),
           "text_field": None if path is None else cfg.text_field, "tokenizer": tok, "max_chars": cfg.max_chars}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _is_valid(entry: Path) -> bool:
    return (entry / "meta.json").is_file() and (entry / "tokens.npy").is_file()


def _iter_documents(path: Optional[str], files: list[Path], cfg: DataConfig, cache: Path) -> Iterator[str]:
    """Yield non-empty documents in order, truncated so that at most `cfg.max_chars` characters come out."""
    if path is None:
        raw: Iterable[str] = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    else:
        raw = _dataset_documents(files, cfg.text_field, cache / "hf_datasets")
    budget = cfg.max_chars if cfg.max_chars is not None else float("inf")
    for doc in raw:
        if budget <= 0:
            return
        if doc:
            doc = doc[: int(min(budget, len(doc)))]
            budget -= len(doc)
            yield doc


def _dataset_documents(files: list[Path], text_field: str, cache_dir: Path) -> Iterator[str]:
    """Documents from local files via `datasets`: one per .txt file, one per json/parquet row."""
    groups: dict[str, list[Path]] = {}
    for f in files:
        groups.setdefault(_BUILDERS[f.suffix.lower()], []).append(f)
    for builder, group in groups.items():
        column = "text" if builder == "text" else text_field
        ds = _load_group(builder, group, column, cache_dir)
        for batch in ds.iter(batch_size=1024):
            yield from (t for t in batch[column] if t)


def _load_group(builder: str, files: list[Path], column: str, cache_dir: Path) -> Any:
    """Load files with one builder; on any problem find the offending file and raise ConfigError naming it."""
    try:
        ds = _hf_load(builder, files, cache_dir)
        if column in ds.column_names:
            return ds
    except Exception:  # located and reported file by file below
        pass
    for f in files:  # error path only: load file by file to name the culprit
        try:
            one = _hf_load(builder, [f], cache_dir)
        except Exception as e:
            raise ConfigError(f"data file {f} could not be read as {builder}: {_one_line(e)}") from e
        if column not in one.column_names:
            raise ConfigError(f"data file {f} has no column {column!r} (columns: {', '.join(one.column_names)}); "
                              "set data.text_field")
    raise ConfigError(f"data files {files[0]} ... could not be read together as {builder} (mixed schemas?)")


def _one_line(e: BaseException) -> str:
    """The wrapped cause of a `datasets` error (e.g. the JSON parse error), as one line."""
    cause = e.__cause__ or e
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"


def _hf_load(builder: str, files: list[Path], cache_dir: Path) -> Any:
    with _offline():
        import datasets

        kwargs = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
        try:
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         cache_dir=str(cache_dir), **kwargs)
        except StopIteration:  # the json builder's answer to a file without rows
            raise ValueError("no rows") from None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Never touch the network and keep `datasets` quiet while loading local files."""
    with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}):
        import datasets  # reads the variables if it was not imported yet; else the patch below does it

        bars, verbosity = datasets.utils.is_progress_bar_enabled(), datasets.logging.get_verbosity()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are re-raised as ConfigError
        try:
            with mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True):
                yield
        finally:
            datasets.logging.set_verbosity(verbosity)
            if bars:
                datasets.enable_progress_bars()


def _train_tokenizer(docs: Iterable[str], vocab_size: int) -> Any:
    """A GPT-2-style byte-level BPE with `<|endoftext|>` as BOS/EOS/UNK, wrapped for `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN)


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {folder} has no eos_token (needed as the document separator)")
    return tokenizer


def encode_documents(tokenizer: Any, docs: Iterable[str], eos_id: int, dtype: Any = np.int32) -> np.ndarray:
    """The token stream: each document encoded without special tokens, followed by `eos_id`, concatenated."""
    encode: Callable[[list[str]], list[list[int]]]
    if getattr(tokenizer, "backend_tokenizer", None) is not None:  # Rust, batched over cores
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: no truncation/padding
        backend.no_truncation()
        backend.no_padding()
        batch_fn = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets
        encode = lambda b: [e.ids for e in batch_fn(b, add_special_tokens=False)]  # noqa: E731
    else:
        encode = lambda b: tokenizer(b, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
    chunks: list[np.ndarray] = []
    it = iter(docs)
    while batch := list(itertools.islice(it, _ENCODE_BATCH)):
        chunks += [np.array([*ids, eos_id], dtype=dtype) for ids in encode(batch)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def _build(cfg: DataConfig, path: Optional[str], files: list[Path], entry: Path) -> None:
    """Train/load the tokenizer, tokenize, and publish `entry` atomically (called under the lock)."""
    t0, where = time.perf_counter(), path or "the embedded stdlib corpus"
    for stale in entry.parent.glob(entry.name + ".tmp-*"):  # left by a crashed builder
        shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        docs = functools.partial(_iter_documents, path, files, cfg, entry.parent)
        lengths = [len(d) for d in docs()]
        if not lengths:
            raise ConfigError(f"data.path={where}: no text found (empty corpus)")
        log.info("building the data cache for %s in %s", where, entry)
        if cfg.tokenizer is None:
            tokenizer = _train_tokenizer(docs(), int(cfg.vocab_size))
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        else:
            tokenizer = _load_tokenizer(Path(cfg.tokenizer))
        dtype, t1 = (np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32), time.perf_counter()
        tokens = encode_documents(tokenizer, docs(), tokenizer.eos_token_id, dtype)
        np.save(tmp / "tokens.npy", tokens)
        meta = {"docs": len(lengths), "chars": sum(lengths), "tokens": int(tokens.size), "source": where,
                "vocab_size": len(tokenizer), "eos_id": int(tokenizer.eos_token_id),
                "build_s": round(time.perf_counter() - t0, 2), "encode_s": round(time.perf_counter() - t1, 2),
                "builder_pid": os.getpid()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in (f for f in tmp.rglob("*") if f.is_file()):  # on disk before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(entry, ignore_errors=True)  # an invalid leftover (no meta) would block the rename
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("data cache built in %.1f s: %d docs, %d chars, %d tokens", meta["build_s"], meta["docs"],
             meta["chars"], meta["tokens"])


def _load(cfg: DataConfig, entry: Path) -> Corpus:
    """Open a valid cache entry and pack its token stream into train/eval sample views."""
    meta = json.loads((entry / "meta.json").read_text())
    tokenizer = _load_tokenizer(entry / "tokenizer" if cfg.tokenizer is None else Path(cfg.tokenizer))
    tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    width = int(cfg.seq_len) + 1
    n = tokens.size // width
    if n < 2:
        raise ConfigError(f"corpus too small: {tokens.size} tokens make {n} < 2 samples of seq_len+1={width}")
    n_eval = min(n - 1, max(1, int(n * float(cfg.eval_fraction))))
    samples = tokens[: n * width].reshape(n, width)
    meta = {**meta, "cache": str(entry)}
    return Corpus(tokenizer=tokenizer, vocab_size=len(tokenizer), eos_id=int(tokenizer.eos_token_id),
                  train=samples[: n - n_eval], eval=samples[n - n_eval:], seq_len=int(cfg.seq_len), meta=meta)
