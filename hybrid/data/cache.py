"""The token cache: one entry per key, built by one process under a file lock, published by a rename.

An entry `corpus-<key>/` holds `meta.json`, `tokens.npy` (the stream) and, when the BPE was trained,
`tokenizer/`. The key hashes everything that determines the stream: the source (its files' sizes and
mtimes, or the hub names and cached Arrow files), the tokenizer (its folder's files but weights, or the BPE's
vocabulary size), `max_chars`, `max_tokens` and `FORMAT`. Not `seq_len`: packing is a view.

Before an entry is used, `problem` checks it against its own meta (cheap enough for every start-up):
meta.json parses; tokens.npy's header is a 1-D integer array of meta's token count and the file is
exactly header + count · itemsize bytes long (a truncated or empty file fails here); a checksum of
`SAMPLES` blocks of `SAMPLE_BYTES` spread evenly over the file (the first and last included) equals the
one recorded at build time (zeroed or overwritten regions that a sample touches fail here: a full
hash of a multi-GB stream would cost seconds on every start-up); and a trained tokenizer/ is there with
its files. A bad entry is rebuilt under the lock, with a warning naming it and what was wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybrid.config import ConfigError
from hybrid.data.sources import fingerprint

if TYPE_CHECKING:
    from hybrid.config import DataConfig

log = logging.getLogger(__name__)

FORMAT = 3  # bump when the cache layout or the build changes (3: meta records tokens.npy's size and checksum)
SAMPLES, SAMPLE_BYTES = 64, 1 << 16  # tokens.npy's sampled checksum: at most 4 MiB read per start-up
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


def sampled_checksum(path: Path) -> str:
    """sha256 of the file's size and of SAMPLES blocks of SAMPLE_BYTES at evenly spaced offsets."""
    size, digest = path.stat().st_size, hashlib.sha256()
    digest.update(str(size).encode())
    step = max(1, (size - SAMPLE_BYTES) // max(1, SAMPLES - 1))
    with open(path, "rb") as f:
        for offset in sorted({min(i * step, max(0, size - SAMPLE_BYTES)) for i in range(SAMPLES)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def stream_record(tokens: Path) -> dict[str, object]:
    """What meta.json records of tokens.npy so that a later run can check it (see `problem`)."""
    return {"tokens_bytes": tokens.stat().st_size, "tokens_checksum": sampled_checksum(tokens)}


def problem(entry: Path, trained_tokenizer: bool) -> Optional[str]:
    """Why the cache entry `entry` cannot be used as it is, else None (see the module docstring)."""
    if not entry.is_dir():
        return "missing"
    try:
        meta = json.loads((entry / "meta.json").read_text())
        count, size, checksum = int(meta["tokens"]), int(meta["tokens_bytes"]), str(meta["tokens_checksum"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json is missing or unreadable ({type(e).__name__})"
    why = _stream_problem(entry / "tokens.npy", count, size)
    if why is None and sampled_checksum(entry / "tokens.npy") != checksum:
        why = "tokens.npy does not match the checksum recorded when it was built"
    if why is None and trained_tokenizer and not (entry / "tokenizer" / "tokenizer.json").is_file():
        why = "its trained tokenizer/ is missing"
    return why


def _stream_problem(path: Path, count: int, size: int) -> Optional[str]:
    """tokens.npy against meta's token count and byte size (the header's shape and dtype, the length)."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            fmt = np.lib.format
            read = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
            header = f.tell()
    except (OSError, ValueError) as e:
        return f"tokens.npy is missing or has no readable header ({type(e).__name__})"
    actual = path.stat().st_size
    if shape != (count,) or dtype.kind not in "iu":
        return f"tokens.npy holds a {dtype} array of shape {shape}, meta.json says {count} token ids"
    if actual != size or actual != header + count * dtype.itemsize:
        return f"tokens.npy is {actual} bytes, {header + count * dtype.itemsize} expected (truncated or overwritten)"
    return None


def build_once(entry: Path, build: Callable[[Path], dict[str, object]], trained_tokenizer: bool) -> None:
    """Build `entry` unless it is usable (`problem`), by one process: the others wait on the lock, then
    find it usable. An entry that exists but is not usable is rebuilt, with a warning naming it."""
    from filelock import FileLock

    if problem(entry, trained_tokenizer) is None:
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        why = problem(entry, trained_tokenizer)
        if why is None:
            return
        if why == "missing":
            publish(entry, build)
            return
        log.warning("data cache entry %s is not usable (%s); rebuilding it", entry, why)
        try:
            publish(entry, build)
        except ConfigError as e:
            raise ConfigError(f"data cache entry {entry} is not usable ({why}) and cannot be rebuilt: {e}") from None


def publish(entry: Path, build: Callable[[Path], dict[str, object]]) -> None:
    """Run `build(tmp)` in a private folder, write its meta, fsync, and rename it to `entry` (atomic)."""
    for stale in entry.parent.glob(entry.name + ".tmp-*"):  # left by a crashed builder
        shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        meta = {**build(tmp), **stream_record(tmp / "tokens.npy")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in (f for f in tmp.rglob("*") if f.is_file()):  # on disk before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(entry, ignore_errors=True)  # an invalid leftover (no meta) would block the rename
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
