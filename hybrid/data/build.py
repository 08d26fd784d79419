"""The cache builder: documents → tokenizer → token stream, on disk at every step.

A table (`datasets.Dataset`, Arrow files memory-mapped from disk) is read three times: a plan (per-row
character counts from Arrow, to place the `data.max_chars` cut), the BPE training when no tokenizer is
given, and the encoding: `datasets.map(batched=True, num_proc=data.num_proc)` writes one int32 list
per document into Arrow files under the build folder, which are then appended, record batch by record
batch, to `tokens.npy` (`NpyWriter`) and deleted. A stream (`IterableDataset`) is encoded batch by
batch straight into `tokens.npy`. The result equals `encode_documents` over the same documents.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from hybrid.config import ConfigError
from hybrid.data.sources import Source, hf_quiet
from hybrid.data.tokenize import (
    BatchEncoder,
    encode_batches,
    encode_rows,
    ids_features,
    load_tokenizer,
    save_tokenizer,
    stream_dtype,
    train_tokenizer,
    truncate,
)
from hybrid.data.tokens import NpyWriter

if TYPE_CHECKING:
    from collections.abc import Iterator

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from hybrid.config import DataConfig
    from hybrid.data.sources import Table

MAP_ROWS = 256  # documents per datasets.map batch, per Arrow record batch, per append to tokens.npy
_PLAN_ROWS = 10_000  # rows per length count (Arrow slices, zero-copy)


@dataclass(frozen=True)
class Plan:
    """Which rows of a table make the corpus under `data.max_chars`."""

    rows: int  # rows read: [0, rows)
    last_chars: Optional[int]  # row rows-1 is cut to this many characters (None: no cut)
    docs: int  # non-empty rows among them
    chars: int


def plan_documents(ds: Dataset, max_chars: Optional[int]) -> Plan:
    """Count characters per row (Arrow's utf8_length: code points, as `len`) up to the `max_chars` cut."""
    import pyarrow.compute as pc

    rows = docs = chars = 0
    for tbl in ds.with_format("arrow").iter(batch_size=_PLAN_ROWS):
        n = pc.fill_null(pc.utf8_length(tbl["text"]), 0).to_numpy().astype(np.int64)
        cum = chars + np.cumsum(n)
        if max_chars is not None and cum[-1] >= max_chars:
            i = int(np.searchsorted(cum, max_chars))  # the first row that reaches the cap (non-empty)
            return Plan(rows + i + 1, int(max_chars - (cum[i] - n[i])), docs + int(np.count_nonzero(n[: i + 1])),
                        int(max_chars))
        rows, docs, chars = rows + len(n), docs + int(np.count_nonzero(n)), int(cum[-1])
    return Plan(rows, None, docs, chars)


def texts(ds: Table) -> Iterator[Optional[str]]:
    """The "text" column, in order, batch by batch."""
    for batch in ds.iter(batch_size=MAP_ROWS):
        yield from batch["text"]


def build_stream(source: Source, cfg: DataConfig, tokenizer_dir: Optional[str], cache_dir: Path,
                 out: Path) -> dict[str, object]:
    """Write `out/tokens.npy` (and `out/tokenizer/` when one is trained); return the entry's meta."""
    t0 = time.perf_counter()
    with hf_quiet(bool(cfg.online)):
        ds = source.open(cache_dir)
        plan = None if source.streaming else plan_documents(ds, cfg.max_chars)
        if plan is not None and plan.docs == 0:
            raise ConfigError(f"{source.where}: no text found (empty corpus)")
        tokenizer = _tokenizer(ds, cfg, tokenizer_dir, out)
        writer, t1 = NpyWriter(out / "tokens.npy", stream_dtype(len(tokenizer)), cfg.max_tokens), time.perf_counter()
        try:
            if plan is None:
                docs, chars = _encode_stream(ds, tokenizer, cfg.max_chars, writer)
            else:
                docs, chars = plan.docs, plan.chars
                _encode_table(ds, plan, tokenizer, cfg.num_proc, writer, out / "work")
        finally:
            tokens = writer.close()
            shutil.rmtree(out / "work", ignore_errors=True)
    if docs == 0:
        raise ConfigError(f"{source.where}: no text found (empty corpus)")
    return {"docs": docs, "chars": chars, "tokens": tokens, "source": source.where, "vocab_size": len(tokenizer),
            "eos_id": int(tokenizer.eos_token_id), "build_s": round(time.perf_counter() - t0, 2),
            "encode_s": round(time.perf_counter() - t1, 2), "builder_pid": os.getpid()}


def _tokenizer(ds: Table, cfg: DataConfig, tokenizer_dir: Optional[str], out: Path) -> PreTrainedTokenizerBase:
    if tokenizer_dir is not None:
        return load_tokenizer(Path(tokenizer_dir))
    tokenizer = train_tokenizer(truncate(texts(ds), cfg.max_chars), int(cfg.vocab_size))
    save_tokenizer(tokenizer, out / "tokenizer")
    return tokenizer


def _encode_table(ds: Dataset, plan: Plan, tokenizer: PreTrainedTokenizerBase, num_proc: Optional[int],
                  writer: NpyWriter, work: Path) -> None:
    """`datasets.map` into Arrow files under `work`, then their record batches appended to `writer`."""
    import pyarrow.compute as pc

    work.mkdir(parents=True, exist_ok=True)
    kwargs = {"encode": BatchEncoder(tokenizer), "eos_id": int(tokenizer.eos_token_id),
              "last_row": plan.rows - 1, "last_chars": plan.last_chars}
    mapped = ds.select(range(plan.rows)).map(
        encode_rows, batched=True, with_indices=True, batch_size=MAP_ROWS, writer_batch_size=MAP_ROWS,
        num_proc=num_proc, remove_columns=["text"], features=ids_features(), fn_kwargs=kwargs,
        cache_file_name=str(work / "ids.arrow"), load_from_cache_file=False,
        new_fingerprint=hashlib.sha256(str(work).encode()).hexdigest()[:32])
    for tbl in mapped.with_format("arrow").iter(batch_size=MAP_ROWS):
        if not writer.append(pc.list_flatten(tbl["ids"]).to_numpy()):
            break


def _encode_stream(ds: Table, tokenizer: PreTrainedTokenizerBase, max_chars: Optional[int],
                   writer: NpyWriter) -> tuple[int, int]:
    """Encode a stream batch by batch into `writer` until it ends, `max_chars` or the writer's limit."""
    docs = chars = 0
    for batch, ids in encode_batches(tokenizer, truncate(texts(ds), max_chars), int(tokenizer.eos_token_id)):
        docs, chars = docs + len(batch), chars + sum(map(len, batch))
        if not writer.append(ids):
            break
    return docs, chars
