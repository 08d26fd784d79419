"""The token cache: one entry per key, built by one process under a file lock, published by a rename.

An entry `corpus-<key>/` holds `meta.json`, `tokens.npy` (the stream) and, when the BPE was trained,
`tokenizer/`. The key hashes everything that determines the stream: the source (its files' sizes and
mtimes, or the hub names and cached Arrow files), the tokenizer (its folder's files but weights, or the BPE's
vocabulary size), `max_chars`, `max_tokens` and `FORMAT`. Not `seq_len`: packing is a view.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybrid.data.sources import fingerprint

if TYPE_CHECKING:
    from hybrid.config import DataConfig

FORMAT = 2  # bump when the cache layout or the build changes (2: tokens.npy streamed, hub/saved sources)
_WEIGHTS = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"}  # beside a tokenizer, not of it


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("HYBRID_CACHE") or Path.home() / ".cache" / "hybrid").expanduser()


def cache_key(cfg: DataConfig, source_key: dict[str, object], tokenizer_dir: Optional[str]) -> str:
    """Hash of everything that determines the tokenizer and the token stream (not seq_len: packing is a view)."""
    if tokenizer_dir is None:
        tok: object = ("bpe", int(cfg.vocab_size))
    else:
        folder = Path(tokenizer_dir).resolve()
        files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix not in _WEIGHTS)
        tok = (str(folder), fingerprint(files))  # a model folder's weights may change: its tokenizer did not
    key = {"format": FORMAT, "source": source_key, "tokenizer": tok, "max_chars": cfg.max_chars,
           "max_tokens": cfg.max_tokens}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def is_valid(entry: Path) -> bool:
    return (entry / "meta.json").is_file() and (entry / "tokens.npy").is_file()


def build_once(entry: Path, build: Callable[[Path], dict[str, object]]) -> None:
    """Build `entry` unless it exists, by one process: the others wait on the lock, then find it valid."""
    from filelock import FileLock

    if is_valid(entry):
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if not is_valid(entry):
            publish(entry, build)


def publish(entry: Path, build: Callable[[Path], dict[str, object]]) -> None:
    """Run `build(tmp)` in a private folder, write its meta, fsync, and rename it to `entry` (atomic)."""
    for stale in entry.parent.glob(entry.name + ".tmp-*"):  # left by a crashed builder
        shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        meta = build(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in (f for f in tmp.rglob("*") if f.is_file()):  # on disk before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(entry, ignore_errors=True)  # an invalid leftover (no meta) would block the rename
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
