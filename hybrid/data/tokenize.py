"""Tokenizers: train a byte-level BPE, load a local transformers folder, encode documents into the stream.

The token stream is each non-empty document encoded without special tokens, followed by the EOS id,
concatenated in document order. `encode_documents` builds it in memory (the reference, fine for small
corpora); `encode_rows` is the same encoding as a `datasets.map` function, one row per document, so
the cache builder can run it over Arrow files on disk, on `data.num_proc` processes.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from hybrid.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # either marks a transformers tokenizer folder
TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}  # transformers 5 name → the name 4.x knows
_ENCODE_BATCH = 256


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> PreTrainedTokenizerBase:
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


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """`save_pretrained`, with a `tokenizer_class` that transformers 4.x can load too (5.x writes its own
    "TokenizersBackend", unknown to 4.x; "PreTrainedTokenizerFast" names the same class in both)."""
    tokenizer.save_pretrained(str(folder))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") in TOKENIZER_CLASSES:
        config["tokenizer_class"] = TOKENIZER_CLASSES[config["tokenizer_class"]]
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The transformers tokenizer saved in `folder`; a folder it cannot load is one ConfigError line."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (a garbled or partial folder fails in many ways: all are bad input)
        text = str(e).strip().splitlines()
        raise ConfigError(f"tokenizer {folder} cannot be loaded ({type(e).__name__}: "
                          f"{text[0] if text else 'no message'})") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {folder} has no eos_token (needed as the document separator)")
    return tokenizer


class SavedTokenizer:
    """The tokenizer a cache entry trained and saved (`entry/tokenizer/`, written by `save_tokenizer`), loaded
    on first use: a run that never encodes or decodes text never imports transformers for it (~1.3 CPU-s per
    process). Anything asked of it is asked of the loaded tokenizer; `save_pretrained` (a checkpoint's copy)
    copies the saved files without loading them."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.loaded = folder, None

    def load(self) -> PreTrainedTokenizerBase:
        if self.loaded is None:
            self.loaded = load_tokenizer(self.folder)
        return self.loaded

    def save_pretrained(self, out: str) -> None:
        shutil.copytree(self.folder, out)

    def __len__(self) -> int:
        return len(self.load())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("folder", "loaded"):  # not set yet (a copy being built): no recursion into load()
            raise AttributeError(name)
        return getattr(self.load(), name)


def resolve_tokenizer(tokenizer: Optional[str], init_from: Optional[str]) -> Optional[str]:
    """`data.tokenizer`, else the tokenizer saved beside `model.init_from`'s weights, else None (train one)."""
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise ConfigError(f"data.tokenizer={tokenizer} is not a directory")
        if not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"data.tokenizer={tokenizer} holds no tokenizer ({' or '.join(TOKENIZER_FILES)} "
                              "is missing)")
        return str(tokenizer)
    if init_from is not None and any((Path(init_from) / f).is_file() for f in TOKENIZER_FILES):
        log.info("data.tokenizer unset: using the tokenizer of model.init_from=%s", init_from)
        return str(init_from)
    return None


def stream_dtype(vocab_size: int) -> type[np.integer]:
    """The narrowest dtype of the cached stream: uint16 when every id fits, else int32."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class BatchEncoder:
    """Encodes a batch of documents without special tokens, truncation or padding; picklable, so that
    `datasets.map(num_proc=N)` can ship it to its worker processes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.backend, self.tokenizer = None, tokenizer
        if getattr(tokenizer, "backend_tokenizer", None) is not None:  # Rust, batched over cores
            from tokenizers import Tokenizer

            self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: no truncation
            self.backend.no_truncation()
            self.backend.no_padding()

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.backend is None:
            return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        batch_fn = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # _fast: no offsets
        return [e.ids for e in batch_fn(texts, add_special_tokens=False)]


def encode_batches(tokenizer: PreTrainedTokenizerBase, docs: Iterable[str], eos_id: int,
                   dtype: Any = np.int32) -> Iterator[tuple[list[str], np.ndarray]]:
    """(documents, their stream) batch by batch: each document encoded, followed by `eos_id`."""
    encode, it = BatchEncoder(tokenizer), iter(docs)
    while batch := list(itertools.islice(it, _ENCODE_BATCH)):
        yield batch, np.concatenate([np.array([*ids, eos_id], dtype=dtype) for ids in encode(batch)])


def encode_documents(tokenizer: PreTrainedTokenizerBase, docs: Iterable[str], eos_id: int,
                     dtype: Any = np.int32) -> np.ndarray:
    """The token stream of `docs`, built in memory (the reference the cache builder is tested against)."""
    chunks = [ids for _, ids in encode_batches(tokenizer, docs, eos_id, dtype)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def truncate(texts: Iterable[Optional[str]], max_chars: Optional[int]) -> Iterator[str]:
    """The non-empty documents of `texts`, in order, the last one cut so that at most `max_chars` come out."""
    budget = float("inf") if max_chars is None else max_chars
    for doc in texts:
        if budget <= 0:
            return
        if doc:
            doc = doc[: int(min(budget, len(doc)))]
            budget -= len(doc)
            yield doc


def encode_rows(batch: dict[str, list[Optional[str]]], indices: list[int], encode: BatchEncoder, eos_id: int,
                last_row: int, last_chars: Optional[int]) -> dict[str, list[np.ndarray]]:
    """A `datasets.map(batched=True, with_indices=True)` function: row i's "ids" are its document's tokens
    and EOS (none for an empty row); row `last_row` is first cut to `last_chars` characters."""
    texts = [(t or "")[:last_chars] if i == last_row and last_chars is not None else (t or "")
             for t, i in zip(batch["text"], indices, strict=True)]
    encoded = iter(encode([t for t in texts if t]))
    empty = np.zeros(0, dtype=np.int32)
    return {"ids": [np.array([*next(encoded), eos_id], dtype=np.int32) if t else empty for t in texts]}


def ids_features() -> Any:
    """The Arrow schema of `encode_rows`' output (one int32 list per document)."""
    import datasets

    return datasets.Features({"ids": datasets.List(datasets.Value("int32"))})
