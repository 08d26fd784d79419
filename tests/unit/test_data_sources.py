"""hybrid.data's sources and builder: save_to_disk folders, hub names from the local cache (and streamed),
token files, the init_from tokenizer, the on-disk builder against `encode_documents`, the config checks.

The reference stream is always `encode_documents` (or the tokenizer called per document) over the same
documents; a "hub" dataset is a local folder loaded once by path into a private HF cache, after which
its bare name resolves from that cache exactly as a downloaded hub dataset does. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from omegaconf import OmegaConf

import hybrid.data.build as build
from hybrid.config import ConfigError, DataConfig, ModelConfig
from hybrid.data import Corpus, encode_documents, prepare_data
from hybrid.data.tokens import NpyWriter
from hybrid.validation import _validate_data

SEQ = 16


def _docs(n: int = 10) -> list[str]:
    src = Path(json.__file__).read_text()
    return [src[i * 700:(i + 1) * 700] + f"\nünïcödé ✓ {i}\n" for i in range(n)]


def _cfg(tmp_path: Path, **kw: object) -> DataConfig:
    cfg = OmegaConf.structured(DataConfig)
    for k, v in {"cache_dir": str(tmp_path / "cache"), "vocab_size": 300, "seq_len": SEQ, "eval_fraction": 0.1,
                 "path": None, **kw}.items():
        setattr(cfg, k, v)
    return cfg


def _jsonl(folder: Path, docs: list[str]) -> Path:
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder / "d.jsonl"


def _stream(corpus: Corpus) -> np.ndarray:
    return np.load(Path(corpus.meta["cache"]) / "tokens.npy")


def _reference(corpus: Corpus, docs: list[str]) -> np.ndarray:
    return encode_documents(corpus.tokenizer, [d for d in docs if d], corpus.eos_id)


def _check(corpus: Corpus, docs: list[str]) -> None:
    """The cached stream is the reference, and the samples are its packing."""
    ref = _reference(corpus, docs)
    np.testing.assert_array_equal(_stream(corpus), ref)
    width = SEQ + 1
    packed = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.eval)])
    np.testing.assert_array_equal(packed, ref[: len(ref) // width * width].reshape(-1, width))


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(err.value)
    assert "\n" not in text and all(n in text for n in needles), text


# ---------------------------------------------------------------- the builder against the reference


@pytest.mark.parametrize("num_proc, max_chars", [(None, None), (2, 3000)])
def test_builder_equals_encode_documents(tmp_path: Path, num_proc: int | None, max_chars: int | None) -> None:
    docs = _docs() + [""]
    rows = [{"text": d} for d in docs[:4]] + [{"text": None}, {"text": ""}] + [{"text": d} for d in docs[4:]]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.jsonl"), num_proc=num_proc, max_chars=max_chars))
    kept, left = [], max_chars if max_chars is not None else 10**9
    for d in (d for d in docs if d):  # the max_chars cut, walked by hand
        kept.append(d[:left])
        left -= len(kept[-1])
        if left == 0:
            break
    _check(corpus, kept)
    assert corpus.meta["docs"] == len(kept) and corpus.meta["chars"] == sum(map(len, kept))


def test_builder_appends_batch_by_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream reaches tokens.npy a few documents at a time, never whole."""
    chunks: list[int] = []
    real_append = NpyWriter.append

    def spy(self: NpyWriter, chunk: np.ndarray) -> bool:
        chunks.append(len(chunk))
        return real_append(self, chunk)

    monkeypatch.setattr(build, "MAP_ROWS", 3)
    monkeypatch.setattr(NpyWriter, "append", spy)
    docs = _docs(12)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    corpus = prepare_data(_cfg(tmp_path, path=str(tmp_path / "saved")))
    _check(corpus, docs)
    ref = _reference(corpus, docs)
    assert len(chunks) == 4 and sum(chunks) == len(ref) and max(chunks) < len(ref) / 2


def test_npy_writer_offsets_limit_and_header(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 60000, size=n).astype(np.int64) for n in (5, 0, 17, 3)]
    writer = NpyWriter(tmp_path / "t.npy", np.uint16, limit=20)
    assert [writer.append(p) for p in parts] == [True, True, False, False]
    assert writer.close() == 20
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), np.concatenate(parts)[:20].astype(np.uint16))


# ---------------------------------------------------------------- save_to_disk folders and hub names


def test_save_to_disk_dataset_and_dataset_dict_split(tmp_path: Path) -> None:
    docs = _docs()
    datasets.Dataset.from_dict({"body": docs, "n": list(range(len(docs)))}).save_to_disk(str(tmp_path / "one"))
    _check(prepare_data(_cfg(tmp_path, path=str(tmp_path / "one"), text_field="body")), docs)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:3]}),
                               "validation": datasets.Dataset.from_dict({"text": docs[3:]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    _check(prepare_data(_cfg(tmp_path, path=str(tmp_path / "dict"), split="validation")), docs[3:])
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(tmp_path, path=str(tmp_path / "dict"), split="test"))
    _one_line(err, "no split 'test'", "validation")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HF datasets cache holding "tiny_corpus", loaded once from a folder of that name."""
    folder = tmp_path / "src" / "tiny_corpus"
    folder.mkdir(parents=True)
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    cache = tmp_path / "hf"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    datasets.load_dataset(str(folder), split="train", cache_dir=str(cache))  # what a download leaves behind
    monkeypatch.chdir(tmp_path)  # "tiny_corpus" is no local path from here: only the cache knows it
    return folder


def test_hub_name_from_the_local_cache(tmp_path: Path, hub_cache: Path) -> None:
    _check(prepare_data(_cfg(tmp_path, dataset="tiny_corpus")), _docs())
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(tmp_path, dataset="tiny_corpus", split="nope"))
    _one_line(err, "data.dataset=tiny_corpus", "nope")


def test_missing_hub_name_offline_is_one_line(tmp_path: Path, hub_cache: Path) -> None:
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(tmp_path, dataset="no_such_corpus"))
    _one_line(err, "data.dataset=no_such_corpus", str(tmp_path / "hf"), "data.online=true")


def test_streaming_equals_the_cached_table(tmp_path: Path, hub_cache: Path) -> None:
    """A stream (here of the local folder; the hub path is the same code) gives the table's stream."""
    table = prepare_data(_cfg(tmp_path, dataset=str(hub_cache), max_chars=2500))
    stream = prepare_data(_cfg(tmp_path, dataset=str(hub_cache), max_chars=2500, streaming=True, online=True))
    assert stream.meta["cache"] != table.meta["cache"] and stream.meta["docs"] == table.meta["docs"]
    np.testing.assert_array_equal(_stream(stream), _stream(table))
    tok = str(Path(table.meta["cache"]) / "tokenizer")
    cut = prepare_data(_cfg(tmp_path, dataset=str(hub_cache), tokenizer=tok, streaming=True, online=True,
                            max_tokens=300))
    np.testing.assert_array_equal(_stream(cut), _reference(cut, _docs())[:300])


# ---------------------------------------------------------------- token files


def _token_files(tmp_path: Path) -> tuple[np.ndarray, Path]:
    """A stream encoded by a trained tokenizer (saved under tmp/tok), written as .bin and .npy."""
    corpus = prepare_data(_cfg(tmp_path, path=str(_jsonl(tmp_path, _docs(30)))))
    corpus.tokenizer.save_pretrained(str(tmp_path / "tok"))
    ids = _stream(corpus)
    ids.astype(np.uint16).tofile(tmp_path / "t16.bin")
    ids.astype(np.uint32).tofile(tmp_path / "t32.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int32))
    return ids, tmp_path / "tok"


def test_token_files_are_packed_in_place(tmp_path: Path) -> None:
    ids, tok = _token_files(tmp_path)
    width = SEQ + 1
    packed = ids[: len(ids) // width * width].reshape(-1, width)
    for name, kw in [("t16.bin", {}), ("t32.bin", {"token_dtype": "uint32"}), ("t.npy", {}),
                     ("t16.bin", {"tokenizer": str(tok)})]:
        corpus = prepare_data(_cfg(tmp_path / "other", path=str(tmp_path / name), **kw))
        np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.eval]), packed)
        assert isinstance(corpus.train, np.memmap) and corpus.meta["cache"] is None
        assert (corpus.tokenizer is None) == ("tokenizer" not in kw)
        assert corpus.vocab_size == (len(corpus.tokenizer) if corpus.tokenizer else int(ids.max()) + 1)
    assert not (tmp_path / "other").exists()  # nothing was cached
    capped = prepare_data(_cfg(tmp_path, path=str(tmp_path / "t.npy"), max_tokens=10 * width))
    assert capped.meta["tokens"] == 10 * width


@pytest.mark.parametrize("case, needles", [
    ("odd.bin", ("3 bytes", "data.token_dtype")),
    ("t.npy+uint16", ("contradicts", "int32")),
    ("2d.npy", ("1-D",)),
    ("neg.npy", ("negative",)),
    ("big.bin+tok", ("token id 300", "tok")),
])
def test_token_file_errors(tmp_path: Path, case: str, needles: tuple[str, ...]) -> None:
    name, _, extra = case.partition("+")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    np.save(tmp_path / "2d.npy", np.zeros((4, 4), dtype=np.int32))
    np.save(tmp_path / "neg.npy", np.array([1, -2, 3] * 20, dtype=np.int32))
    np.arange(301, dtype=np.uint16).tofile(tmp_path / "big.bin")
    kw: dict[str, object] = {"token_dtype": extra} if extra == "uint16" else {}
    if extra == "tok":
        trained = prepare_data(_cfg(tmp_path, path=str(_jsonl(tmp_path, _docs()))))
        trained.tokenizer.save_pretrained(str(tmp_path / "tok"))
        kw = {"tokenizer": str(tmp_path / "tok"), "vocab_size": 300}
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(tmp_path, path=str(tmp_path / name), **kw))
    _one_line(err, *needles)


# ---------------------------------------------------------------- tokenizers


def test_init_from_tokenizer_is_the_default(tmp_path: Path) -> None:
    docs = _docs()
    _jsonl(tmp_path, docs)
    trained = prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.jsonl"), vocab_size=280))
    saved = json.loads((Path(trained.meta["cache"]) / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x as well
    model = tmp_path / "model"
    trained.tokenizer.save_pretrained(str(model))
    (model / "config.json").write_text("{}")
    used = prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.jsonl")), init_from=str(model))
    assert used.vocab_size == trained.vocab_size == 280
    _check(used, docs)
    (tmp_path / "bare").mkdir()
    fresh = prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.jsonl")), init_from=str(tmp_path / "bare"))
    assert fresh.vocab_size == 300 and (Path(fresh.meta["cache"]) / "tokenizer").is_dir()


# ---------------------------------------------------------------- config checks


@pytest.mark.parametrize("kw, model_kw, needles", [
    ({"streaming": True, "dataset": "x", "max_chars": 10}, {}, ("data.online=true",)),
    ({"streaming": True, "online": True}, {}, ("needs data.dataset",)),
    ({"streaming": True, "online": True, "dataset": "x"}, {}, ("bound", "data.max_chars")),
    ({"dataset": "x", "path": "."}, {}, ("not both",)),
    ({"path": "t.bin"}, {}, ("model.vocab_size",)),
    ({"path": "t.npy", "token_dtype": "uint16"}, {"vocab_size": 512}, ("applies to a .bin",)),
    ({"path": "t.bin", "token_dtype": "int8"}, {"vocab_size": 512}, ("not one of",)),
    ({"num_proc": 0}, {}, ("data.num_proc",)),
])
def test_bad_combinations_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kw: dict, model_kw: dict,
                                      needles: tuple[str, ...]) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("t.bin", "t.npy"):
        Path(name).write_bytes(b"")
    data, model = _cfg(tmp_path, **kw), OmegaConf.structured(ModelConfig)
    for k, v in model_kw.items():
        setattr(model, k, v)
    with pytest.raises(ConfigError) as err:
        _validate_data(data, model)
    _one_line(err, *needles)
