"""hybrid.data: loading, tokenizer, packing, the cache and its lock, the sampler and eval indices.

Every expectation is a direct computation (tokenize the documents again, walk the sample stream),
never a hand-written constant. Caches live under tmp_path (the full default corpus: the suite's HYBRID_CACHE
when set), never ~/.cache.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

import hybrid.data as data
import hybrid.data.build as build
import hybrid.data.corpus as corpus_mod
import hybrid.data.sources as sources
from hybrid.config import ConfigError, DataConfig
from hybrid.data import prepare_data
from hybrid.sampler import StepSampler, batch_from, eval_indices

SEQ = 16


def _docs(n: int = 12) -> list[str]:
    """Real, varied text: slices of stdlib sources plus some non-ASCII, one per document."""
    src = Path(json.__file__).read_text() + Path(os.__file__).read_text()
    return [src[i * 900:(i + 1) * 900] + f"\nünïcödé ✓ — doc {i}\n" for i in range(n)]


def _cfg(tmp_path: Path, **kw: object) -> object:
    cfg = OmegaConf.structured(DataConfig)
    base = {"cache_dir": str(tmp_path / "cache"), "vocab_size": 300, "seq_len": SEQ, "eval_fraction": 0.1}
    for k, v in {**base, **kw}.items():
        setattr(cfg, k, v)
    return cfg


def _reference(corpus: data.Corpus, docs: list[str], eval_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize each document with the corpus tokenizer, append EOS, concatenate, chunk, split."""
    ids: list[int] = []
    for d in docs:
        ids += corpus.tokenizer(d, add_special_tokens=False)["input_ids"] + [corpus.eos_id]
    width = corpus.seq_len + 1
    n = len(ids) // width
    samples = np.array(ids[: n * width]).reshape(n, width)
    n_eval = max(1, int(n * eval_fraction))
    return samples[: n - n_eval], samples[n - n_eval:]


def _check_packing(corpus: data.Corpus, docs: list[str]) -> None:
    train, evals = _reference(corpus, docs)
    np.testing.assert_array_equal(np.asarray(corpus.train), train)
    np.testing.assert_array_equal(np.asarray(corpus.eval), evals)
    assert corpus.train.shape[1] == corpus.seq_len + 1 and len(corpus.eval) >= 1


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# ---------------------------------------------------------------- loading and packing


def test_jsonl_packing_matches_reference(tmp_path: Path) -> None:
    docs = _docs()
    corpus = prepare_data(_cfg(tmp_path, path=str(_write_jsonl(tmp_path / "d.jsonl", docs))))
    _check_packing(corpus, docs)
    assert corpus.vocab_size == len(corpus.tokenizer) <= 300
    assert corpus.eos_id == corpus.tokenizer.convert_tokens_to_ids(data.EOS_TOKEN)
    first = np.concatenate([np.asarray(corpus.train).ravel(), np.asarray(corpus.eval).ravel()])
    end = int(np.flatnonzero(first == corpus.eos_id)[0])
    assert corpus.tokenizer.decode(first[:end].tolist()) == docs[0]  # byte-level BPE is lossless


def test_txt_folder_one_document_per_file(tmp_path: Path) -> None:
    docs = _docs(6)
    folder = tmp_path / "txt"
    (folder / "sub").mkdir(parents=True)
    paths = [folder / f"{i:02d}.txt" for i in range(4)] + [folder / "sub" / f"{i}.txt" for i in range(2)]
    for p, d in zip(paths, docs, strict=True):
        p.write_text(d)
    (folder / ".hidden.csv").write_text("ignored")
    corpus = prepare_data(_cfg(tmp_path, path=str(folder)))
    _check_packing(corpus, [p.read_text() for p in sorted(paths)])


def test_parquet_and_json_array_and_text_field(tmp_path: Path) -> None:
    docs = _docs()
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "d.parquet")
    _check_packing(prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.parquet"), text_field="body")), docs)
    (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in docs]))
    _check_packing(prepare_data(_cfg(tmp_path, path=str(tmp_path / "d.json"))), docs)


def test_max_chars_truncates_the_corpus(tmp_path: Path) -> None:
    docs = _docs()
    cap = len(docs[0]) + len(docs[1]) + 100
    corpus = prepare_data(_cfg(tmp_path, path=str(_write_jsonl(tmp_path / "d.jsonl", docs)), max_chars=cap))
    assert corpus.meta["chars"] == cap and corpus.meta["docs"] == 3
    _check_packing(corpus, [docs[0], docs[1], docs[2][:100]])


def test_local_tokenizer_folder_gives_the_same_stream(tmp_path: Path) -> None:
    docs = _docs()
    path = str(_write_jsonl(tmp_path / "d.jsonl", docs))
    trained = prepare_data(_cfg(tmp_path, path=path))
    trained.tokenizer.save_pretrained(str(tmp_path / "tok"))
    local = prepare_data(_cfg(tmp_path, path=path, tokenizer=str(tmp_path / "tok")))
    assert local.meta["cache"] != trained.meta["cache"] and local.eos_id == trained.eos_id
    np.testing.assert_array_equal(np.asarray(local.train), np.asarray(trained.train))
    _check_packing(local, docs)


def test_default_corpus_small(tmp_path: Path) -> None:
    corpus = prepare_data(_cfg(tmp_path, path=None, max_chars=200_000, vocab_size=512))
    files = sources._stdlib_files()
    names = {p.name for p in files}
    assert "topics.py" in names and "os.py" in names
    assert not any(part in {"test", "tests", "site-packages", "idlelib"} for p in files for part in p.parts)
    texts, left = [], 200_000
    for p in files:
        t = p.read_text(encoding="utf-8", errors="replace")[:left]
        if t:
            texts.append(t)
            left -= len(t)
        if left == 0:
            break
    assert corpus.meta["chars"] == 200_000
    _check_packing(corpus, texts)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name, content, field, match",
    [
        ("d.jsonl", '{"body": "x"}\n', "text", "no column 'text'"),
        ("d.parquet", None, "text", "no column 'text'"),
        ("d.jsonl", "", "text", "empty corpus"),
        ("d.txt", "", "text", "empty corpus"),
        ("d.csv", "text\nhello\n", "text", "unsupported extension"),
        ("d.jsonl", '{"text": "ok"}\n{not json\n', "text", "could not be read as json"),
    ],
)
def test_bad_inputs_raise_config_error(tmp_path: Path, name: str, content: str | None, field: str,
                                       match: str) -> None:
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"body": ["x"]}), path)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        prepare_data(_cfg(tmp_path, path=str(path), text_field=field))
    assert "\n" not in str(err.value) and (str(path) in str(err.value) or "data.path" in str(err.value))


def test_bad_file_in_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", _docs(3))
    _write_jsonl(folder / "b.jsonl", _docs(3), field="body")
    with pytest.raises(ConfigError, match="b.jsonl has no column"):
        prepare_data(_cfg(tmp_path, path=str(folder)))


def test_missing_or_absent_path(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cfg.path = "???"
    with pytest.raises(ConfigError, match="data.path is required"):
        prepare_data(cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_data(_cfg(tmp_path, path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ConfigError, match="too small"):
        prepare_data(_cfg(tmp_path, path=str(_write_jsonl(tmp_path / "d.jsonl", ["tiny"]))))


# ---------------------------------------------------------------- the cache


def _no_build(*args: object, **kwargs: object) -> None:
    raise AssertionError("the cache was rebuilt")


def test_second_call_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", _docs()))
    first = prepare_data(_cfg(tmp_path, path=path))
    tokens = Path(first.meta["cache"]) / "tokens.npy"
    mtime = tokens.stat().st_mtime_ns
    monkeypatch.setattr(corpus_mod, "_build", _no_build)
    again = prepare_data(_cfg(tmp_path, path=path))
    longer = prepare_data(_cfg(tmp_path, path=path, seq_len=2 * SEQ, eval_fraction=0.2))  # a view: no rebuild
    assert tokens.stat().st_mtime_ns == mtime and again.meta == first.meta
    np.testing.assert_array_equal(np.asarray(again.train), np.asarray(first.train))
    assert longer.train.shape[1] == 2 * SEQ + 1 and longer.meta["cache"] == first.meta["cache"]
    with pytest.raises(AssertionError, match="rebuilt"):  # a different vocabulary is a different entry
        prepare_data(_cfg(tmp_path, path=path, vocab_size=301))


def test_changed_source_file_rebuilds(tmp_path: Path) -> None:
    docs = _docs()
    path = _write_jsonl(tmp_path / "d.jsonl", docs)
    first = prepare_data(_cfg(tmp_path, path=str(path)))
    _write_jsonl(path, docs[::-1])
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = prepare_data(_cfg(tmp_path, path=str(path)))
    assert second.meta["cache"] != first.meta["cache"]
    _check_packing(second, docs[::-1])


def test_crashed_build_leaves_nothing_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _docs()
    path = str(_write_jsonl(tmp_path / "d.jsonl", docs))

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(build.NpyWriter, "append", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(_cfg(tmp_path, path=path))
    monkeypatch.undo()
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("corpus-")]
    assert all(n.endswith(".lock") for n in leftovers)  # no entry, no tmp folder
    _check_packing(prepare_data(_cfg(tmp_path, path=path)), docs)


def _worker(cfg_yaml: str, barrier: object, queue: object) -> None:
    barrier.wait()
    corpus = prepare_data(OmegaConf.create(cfg_yaml))
    queue.put((np.asarray(corpus.train).tobytes(), np.asarray(corpus.eval).tobytes(), corpus.meta["builder_pid"]))


def test_concurrent_prepare_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _docs(40)
    cfg = _cfg(tmp_path, path=str(_write_jsonl(tmp_path / "d.jsonl", docs)))
    builds = tmp_path / "builds.log"
    real_build = corpus_mod._build

    def counting_build(*args: object) -> dict:
        with open(builds, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_build(*args)

    monkeypatch.setattr(corpus_mod, "_build", counting_build)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(OmegaConf.to_yaml(cfg), barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(builds.read_text().split()) == 1
    assert len({r for r in results}) == 1
    monkeypatch.setattr(corpus_mod, "_build", _no_build)
    _check_packing(prepare_data(cfg), docs)
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------- sampler, eval indices, batches

G = 16
LAYOUTS = [(16, 1, 1), (4, 4, 1), (2, 4, 2), (8, 1, 2), (1, 4, 4), (2, 2, 4), (4, 1, 4)]  # (mbs, microbatches, dp)


def _stream(mbs: int, nmb: int, dp: int, steps: int, n: int = 97, seed: int = 7, consumed: int = 0,
            state: dict | None = None) -> list[np.ndarray]:
    """Per step, the global sample stream rebuilt from every rank's microbatches (position order)."""
    samplers = [StepSampler(n, mbs, nmb, dp, d, seed, consumed) for d in range(dp)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    out = []
    for _ in range(steps):
        per_rank = [s.next_step() for s in samplers]
        out.append(np.concatenate([per_rank[d][j] for j in range(nmb) for d in range(dp)]))
    assert len({s.consumed_samples for s in samplers}) == 1
    return out


def test_sampler_is_layout_independent() -> None:
    reference = _stream(*LAYOUTS[0], steps=20)
    for layout in LAYOUTS[1:]:
        for a, b in zip(_stream(*layout, steps=20), reference, strict=True):
            np.testing.assert_array_equal(a, b)  # same samples, even in the same positions


def test_sampler_epochs_are_permutations() -> None:
    n = 97
    flat = np.concatenate(_stream(4, 2, 2, steps=3 * n // G + 1, n=n))
    for e in range(3):
        np.testing.assert_array_equal(np.sort(flat[e * n:(e + 1) * n]), np.arange(n))
    assert not np.array_equal(flat[:n], flat[n:2 * n])  # each epoch reshuffled
    other = np.concatenate(_stream(4, 2, 2, steps=6, n=n, seed=8))
    assert not np.array_equal(flat[: len(other)], other)


def test_sampler_resume_with_a_different_dp() -> None:
    full = _stream(2, 4, 2, steps=15)
    sampler = StepSampler(97, 2, 4, 2, 1, 7)
    for _ in range(6):
        sampler.next_step()
    state = sampler.state_dict()
    assert state == {"consumed_samples": 6 * G, "seed": 7}
    for layout in [(1, 4, 4), (16, 1, 1), (8, 1, 2)]:
        resumed = _stream(*layout, steps=9, seed=0, state=state)  # the saved seed wins
        for a, b in zip(resumed, full[6:], strict=True):
            np.testing.assert_array_equal(a, b)
    via_arg = _stream(4, 1, 4, steps=9, consumed=6 * G)
    for a, b in zip(via_arg, full[6:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        StepSampler(10, 2, 2, 2, 2, 0)
    with pytest.raises(ValueError):
        StepSampler(0, 2, 2, 2, 0, 0)


@pytest.mark.parametrize("num_eval", [5, 64, 200])
def test_eval_indices_same_global_set(num_eval: int) -> None:
    total = 64  # mbs · dp · num_batches held constant

    def global_set(mbs: int, dp: int) -> np.ndarray:
        per_rank = [eval_indices(num_eval, mbs, dp, d, total // (mbs * dp)) for d in range(dp)]
        return np.concatenate([per_rank[d][b] for b in range(len(per_rank[0])) for d in range(dp)])

    ref = global_set(8, 1)
    np.testing.assert_array_equal(ref, np.arange(total) % num_eval)
    for mbs, dp in [(4, 2), (2, 4), (1, 8), (16, 2)]:
        np.testing.assert_array_equal(global_set(mbs, dp), ref)


def test_batch_from_shifts_by_one() -> None:
    samples = np.random.default_rng(0).integers(0, 60000, size=(10, SEQ + 1)).astype(np.uint16)
    idx = np.array([7, 2, 2, 9])
    x, y = batch_from(samples, idx)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ)
    ref = torch.tensor(samples[idx].astype(np.int64))
    torch.testing.assert_close(x, ref[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(y, ref[:, 1:], rtol=0, atol=0)


@pytest.mark.slow
def test_default_corpus_full(tmp_path: Path, cache: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real embedded corpus with the default 8192 vocabulary (~20 CPU-s to build), then a cached call; in the
    suite's own HYBRID_CACHE when one is set (the `cache` fixture: the runs on the default corpus share it, so a
    suite builds it once), else in a fresh folder."""
    cfg = _cfg(tmp_path, path=None, vocab_size=8192, seq_len=128, eval_fraction=0.01, cache_dir=None)
    corpus = prepare_data(cfg)
    assert corpus.vocab_size == 8192 and corpus.meta["chars"] > 5_000_000
    n = corpus.meta["tokens"] // 129
    assert corpus.train.shape == (n - max(1, int(n * 0.01)), 129) and corpus.eval.shape[0] == max(1, int(n * 0.01))
    monkeypatch.setattr(corpus_mod, "_build", _no_build)
    again = prepare_data(cfg)
    np.testing.assert_array_equal(np.asarray(again.eval), np.asarray(corpus.eval))
