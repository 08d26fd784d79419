"""A damaged data cache entry (hybrid.data.cache.problem) is found before use and rebuilt under the lock with
a warning naming it; the rebuilt corpus equals the one first built (the reference). An entry that cannot
be rebuilt because its source is gone is one ConfigError line naming the entry; a damaged token file given
as data.path is one ConfigError line.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from hybrid.config import ConfigError, DataConfig
from hybrid.data import prepare_data
from hybrid.data.cache import problem


def _cfg(source: Path, cache: Path) -> DataConfig:
    cfg = OmegaConf.structured(DataConfig)
    for k, v in {"path": str(source), "cache_dir": str(cache), "vocab_size": 300, "seq_len": 16,
                 "eval_fraction": 0.1}.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """(source file, its built entry, train and eval samples of the first build): the reference."""
    root = tmp_path_factory.mktemp("cache")
    source = root / "docs.txt"
    source.write_text("".join(Path(json.__file__).read_text()[i * 700:(i + 1) * 700] + "\n\n" for i in range(8)))
    corpus = prepare_data(_cfg(source, root / "a"))
    return source, Path(corpus.meta["cache"]), np.array(corpus.train), np.array(corpus.eval)


def _truncate(e: Path) -> None:
    f = e / "tokens.npy"
    f.write_bytes(f.read_bytes()[:-100])


def _zero_middle(e: Path) -> None:  # same size: only the recorded checksum can tell
    data = bytearray((e / "tokens.npy").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    (e / "tokens.npy").write_bytes(bytes(data))


def _wrong_count(e: Path) -> None:
    meta = json.loads((e / "meta.json").read_text())
    (e / "meta.json").write_text(json.dumps({**meta, "tokens": meta["tokens"] + 1}))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "expected (truncated or overwritten)"),
    "empty": (lambda e: (e / "tokens.npy").write_bytes(b""), "tokens.npy is missing or has no readable header"),
    "zeroed": (_zero_middle, "does not match the checksum"),
    "garbled meta": (lambda e: (e / "meta.json").write_text("{not json"), "meta.json is missing or unreadable"),
    "wrong count": (_wrong_count, "meta.json says"),
    "no tokenizer": (lambda e: shutil.rmtree(e / "tokenizer"), "its trained tokenizer/ is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_rebuilt_with_a_warning(damage: str, built: tuple, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    source, entry, train, evals = built
    copy = tmp_path / "cache" / entry.name
    shutil.copytree(entry, copy)
    assert problem(copy, True) is None
    hurt, why = DAMAGE[damage]
    hurt(copy)
    assert why in (problem(copy, True) or "")
    with caplog.at_level(logging.WARNING, logger="hybrid.data.cache"):
        corpus = prepare_data(_cfg(source, tmp_path / "cache"))
    assert Path(corpus.meta["cache"]) == copy and problem(copy, True) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(copy) in warnings[0] and why in warnings[0]
    np.testing.assert_array_equal(np.asarray(corpus.train), train)
    np.testing.assert_array_equal(np.asarray(corpus.eval), evals)


def test_an_entry_whose_source_is_gone_is_one_line(built: tuple, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source, entry, _, _ = built
    copy = tmp_path / "cache" / entry.name
    shutil.copytree(entry, copy)
    _truncate(copy)

    def gone(*_: object) -> dict:
        raise ConfigError(f"data.path={source}: cannot be read")

    monkeypatch.setattr("hybrid.data.corpus.build_stream", gone)  # the source vanished after the key was made
    with pytest.raises(ConfigError, match=f"data cache entry {copy} is not usable .* cannot be rebuilt: data.path="):
        prepare_data(_cfg(source, tmp_path / "cache"))


@pytest.mark.parametrize("name,content,why", [
    ("t.npy", b"", "is not a readable .npy file"),
    ("t.bin", b"\x01\x00\x02", "is not a whole, non-zero number of uint16 token ids"),
    ("t.bin", b"", "is not a whole, non-zero number"),
])
def test_a_damaged_token_file_is_one_line(name: str, content: bytes, why: str, tmp_path: Path) -> None:
    (tmp_path / name).write_bytes(content)
    cfg = _cfg(tmp_path / name, tmp_path / "cache")
    cfg.tokenizer = None
    with pytest.raises(ConfigError, match=why):
        prepare_data(cfg)


def test_a_truncated_npy_token_file_is_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.uint16))
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[:-10])
    with pytest.raises(ConfigError, match="is not a readable .npy file"):
        prepare_data(_cfg(tmp_path / "t.npy", tmp_path / "cache"))
