"""Where documents come from: each source opens as a `datasets` table with one "text" column.

`resolve_source(cfg)` names a corpus and what its cache key hashes, reading no text:
- `data.path=null`: the embedded corpus, this Python's stdlib sources and pydoc docs, one file a document;
- `data.path=<file or folder>` of .txt (a file is a document) / .jsonl / .json / .parquet (a row is one);
- `data.path=<a datasets.save_to_disk folder>`: a Dataset, or a DatasetDict and its `data.split`;
- `data.dataset=<hub name>` (+ `data.dataset_config`, `data.split`): from the local Hugging Face datasets
  cache, offline, unless `data.online=true`; `data.streaming=true` reads it from the hub as a stream.
Token files (.bin/.npy) hold no documents: `hybrid.data.tokens` reads them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union
from unittest import mock

from hybrid.config import ConfigError

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from hybrid.config import DataConfig

    Table = Union[Dataset, IterableDataset]

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what `save_to_disk` writes: DatasetDict / Dataset
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


@dataclass(frozen=True)
class Source:
    """A corpus of documents, not yet read."""

    where: str  # how messages name it
    key: dict[str, object]  # everything about it that determines the documents (hashed into the cache key)
    open: Callable[[Path], Table]  # (a cache folder for datasets' Arrow files) -> one "text" column
    streaming: bool = False


def resolve_source(cfg: DataConfig) -> Source:
    if cfg.dataset is not None:
        return _hub_source(cfg)
    path = cfg_path(cfg)
    if path is None:
        files = _stdlib_files()
        key = {"python": sys.version, "files": fingerprint(files)}
        return Source("the embedded stdlib corpus", key, functools.partial(_stdlib_table, files, _digest(key)))
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ConfigError(f"data.path={path} does not exist")
    if p.is_dir() and any((p / m).is_file() for m in SAVED_MARKERS):
        key = {"saved": fingerprint(_tree(p)), "split": cfg.split, "text_field": cfg.text_field}
        return Source(f"data.path={path}", key, lambda _: _saved_table(p, cfg.split, cfg.text_field))
    files = _source_files(p, path)
    key = {"files": fingerprint(files), "text_field": cfg.text_field}
    return Source(f"data.path={path}", key, functools.partial(_files_table, files, cfg.text_field))


def cfg_path(cfg: DataConfig) -> Optional[str]:
    from omegaconf import OmegaConf

    if (OmegaConf.is_config(cfg) and OmegaConf.is_missing(cfg, "path")) or cfg.path == "???":
        raise ConfigError("data.path is required for this data config (data.path=<file or folder>)")
    return None if cfg.path is None else str(cfg.path)


def fingerprint(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    return [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def _digest(key: object) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _tree(folder: Path) -> list[Path]:
    """The files under `folder`, sorted, hidden ones (any part starting with ".") left out."""
    return sorted(f for f in folder.rglob("*") if f.is_file()
                  and not any(s.startswith(".") for s in f.relative_to(folder).parts))


def _stdlib_files() -> list[Path]:
    """The standard library's .py sources (incl. pydoc_data/topics.py), tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        files += [Path(d, n) for n in sorted(names) if n.endswith(".py") and not n.startswith("_sysconfigdata")]
    return files


def _source_files(p: Path, path: str) -> list[Path]:
    """The files to read, in a deterministic order; ConfigError for unknown extensions or no text."""
    files = [p] if p.is_file() else _tree(p)
    for f in files:
        if f.suffix.lower() not in BUILDERS:
            raise ConfigError(f"data file {f} has an unsupported extension (use {', '.join(BUILDERS)}, "
                              "a save_to_disk folder, or a .bin/.npy token file)")
    if not any(f.stat().st_size for f in files):
        raise ConfigError(f"data.path={path}: no text found (empty corpus)")
    return [f for f in files if f.stat().st_size]


def _read_files(files: list[str]) -> Iterator[dict[str, str]]:
    for f in files:
        yield {"text": Path(f).read_text(encoding="utf-8", errors="replace")}


def _stdlib_table(files: list[Path], digest: str, cache_dir: Path) -> Dataset:
    """The stdlib files as an Arrow table on disk (one row per file), rebuilt when `digest` changes."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string")})
    return datasets.Dataset.from_generator(_read_files, features=features, cache_dir=str(cache_dir),
                                           gen_kwargs={"files": [str(f) for f in files]}, fingerprint=digest)


def text_column(ds: Table, column: str, where: str) -> Table:
    """`ds` reduced to its `column`, renamed "text"; ConfigError when it is missing or holds no text."""
    names = list(ds.column_names or [])
    if names and column not in names:
        raise ConfigError(f"{where} has no column {column!r} (columns: {', '.join(names)}); set data.text_field")
    feature = (ds.features or {}).get(column)
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(f"{where}: column {column!r} holds {feature}, not text; set data.text_field")
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def _saved_table(folder: Path, split: str, column: str) -> Dataset:
    import datasets

    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"data.path={folder} has no split {split!r} (splits: {', '.join(ds)}); set data.split")
        ds = ds[split]
    return text_column(ds, column, f"data.path={folder}")


def _files_table(files: list[Path], text_field: str, cache_dir: Path) -> Dataset:
    """Local files via `datasets`, one builder per kind, in the order of their first file, concatenated."""
    import datasets

    groups: dict[str, list[Path]] = {}
    for f in files:
        groups.setdefault(BUILDERS[f.suffix.lower()], []).append(f)
    tables = [_load_group(builder, group, "text" if builder == "text" else text_field, cache_dir)
              for builder, group in groups.items()]
    return tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)


def _load_group(builder: str, files: list[Path], column: str, cache_dir: Path) -> Dataset:
    """Load files with one builder; on any problem find the offending file and raise ConfigError naming it."""
    try:
        ds = _hf_load(builder, files, cache_dir)
        if column in ds.column_names:
            return text_column(ds, column, f"data files {files[0]} ...")
    except Exception:  # located and reported file by file below
        pass
    for f in files:  # error path only: load file by file to name the culprit
        try:
            one = _hf_load(builder, [f], cache_dir)
        except Exception as e:
            raise ConfigError(f"data file {f} could not be read as {builder}: {one_line(e)}") from e
        text_column(one, column, f"data file {f}")
    raise ConfigError(f"data files {files[0]} ... could not be read together as {builder} (mixed schemas?)")


def one_line(e: BaseException) -> str:
    """The wrapped cause of a `datasets` error (e.g. the JSON parse error), as one line."""
    cause = e.__cause__ or e
    text = " ".join(str(cause).split())
    return f"{type(cause).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"


def _hf_load(builder: str, files: list[Path], cache_dir: Path) -> Dataset:
    import datasets

    kwargs = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(cache_dir), **kwargs)
    except StopIteration:  # the json builder's answer to a file without rows
        raise ValueError("no rows") from None


def _hub_source(cfg: DataConfig) -> Source:
    """A hub dataset: its cached Arrow files are opened (and stat'ed for the key) now; a stream only
    when read, so its key holds the names alone."""
    name, config, split = str(cfg.dataset), cfg.dataset_config, str(cfg.split)
    where = f"data.dataset={name}" + (f" data.dataset_config={config}" if config else "")
    key: dict[str, object] = {"dataset": name, "config": config, "split": split, "text_field": cfg.text_field}
    if cfg.streaming:
        opener = functools.partial(_hub_table, name, config, split, cfg.text_field, bool(cfg.online), True)
        return Source(where, {**key, "streaming": True}, lambda _: opener(), streaming=True)
    ds = _hub_table(name, config, split, cfg.text_field, bool(cfg.online), False)
    files = [Path(c["filename"]) for c in ds.cache_files]
    return Source(where, {**key, "files": fingerprint(files)}, lambda _: ds)


def _hub_table(name: str, config: Optional[str], split: str, column: str, online: bool, streaming: bool) -> Table:
    import datasets

    where = f"data.dataset={name}"
    with hf_quiet(online):
        try:
            ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
        except (ConnectionError, FileNotFoundError) as e:
            if online:
                raise ConfigError(f"{where} could not be loaded: {one_line(e)}") from None
            raise ConfigError(f"{where} is not in the local Hugging Face datasets cache "
                              f"({datasets.config.HF_DATASETS_CACHE}); fetch it once with data.online=true, "
                              "or use data.path=<a save_to_disk folder>") from None
        except ValueError as e:  # unknown config or split
            raise ConfigError(f"{where}: {one_line(e)}") from None
    return text_column(ds, column, where)


@contextlib.contextmanager
def hf_quiet(online: bool = False) -> Iterator[None]:
    """Keep `datasets` quiet (its failures are re-raised as ConfigError) and, unless `online`, off the
    network: the Hugging Face offline switches, read at import or at call time, are all set."""
    import datasets
    import huggingface_hub

    bars, verbosity = datasets.utils.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    with contextlib.ExitStack() as stack:
        if not online:
            stack.enter_context(mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}))
            stack.enter_context(mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True))
            stack.enter_context(mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True))
        try:
            yield
        finally:
            datasets.logging.set_verbosity(verbosity)
            if bars:
                datasets.enable_progress_bars()
