"""Checkpoint folders on disk: where a step's folder is, whether it is complete, the newest one,
its manifest, the `latest` link, and which folders keep-k removes.

One folder per step, `<checkpoint.dir>/<run name>/step_0000100/`. It is complete exactly when DCP's
`.metadata` exists (written last, by rank 0, through a rename): a crash mid-save leaves a folder
without it, which `checkpoint.resume=auto` skips with a warning and the next cleanup removes.
No collectives here: only rank 0 (or one process) calls these. Also the small helpers the other
modules share: an exception's one-line text, whether a process group spans several ranks, and the
filter for DCP's single-process warning.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from hybrid.checkpoint.trust import safe_reader, untrusted
from hybrid.config import Config, ConfigError

MANIFEST, METADATA, FORMAT = "hybrid.json", ".metadata", 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
Log = Callable[[str], None]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (missing, partial, corrupt, another model): one line, exit 2."""


class NonFiniteState(RuntimeError):
    """The state due to be saved holds a NaN or an inf: it was not saved, and nothing was removed."""


def run_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) / cfg.run_name


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_*` folder under `root`, oldest first, complete or not. A symbolic
    link named like one is not a folder this run wrote: it is neither resumed nor removed."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete, loadable checkpoint; None when it is. Checks the manifest, DCP's
    index, and that every shard file the index names exists and is as long as the index says. A symbolic
    link is judged by its target."""
    path = path.resolve()
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    if not (path / MANIFEST).is_file():
        return f"is not a hybrid checkpoint ({MANIFEST} is missing)"
    if not (path / METADATA).is_file():
        return f"is incomplete: {METADATA} is missing (the save did not finish)"
    for p in (path, path / MANIFEST, path / METADATA):
        if why := untrusted(p):
            return f"is not trusted: {p.name} {why} (a copy you make is yours: cp -r it into a folder of yours)"
    try:
        read_manifest(path)
    except Exception as e:  # noqa: BLE001  (any unreadable manifest is a corrupt checkpoint)
        return f"is corrupt: cannot read its {MANIFEST} ({first_line(e)})"
    try:
        md = safe_reader(str(path)).read_metadata()  # a restricted unpickler: a crafted index runs no code
    except Exception as e:  # noqa: BLE001  (any unreadable index is a corrupt checkpoint)
        return f"is corrupt: cannot read its index {METADATA} ({first_line(e)})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            return f"is corrupt: shard file {rel} is missing"
        if f.stat().st_size < size:
            return f"is corrupt: shard file {rel} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def find_latest(root: Path, warn: Log) -> Optional[Path]:
    """The newest complete checkpoint under `root`; incomplete or corrupt ones are skipped with a warning."""
    for _, path in reversed(list_steps(root)):
        why = problem(path)
        if why is None:
            return path
        warn(f"warning: checkpoint {path} {why}; skipping it")
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text(encoding="utf-8"))


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def point_latest(root: Path, path: Path) -> None:
    """`<root>/latest` → the newest complete checkpoint (a relative symlink, swapped in by rename)."""
    tmp = root / ".latest.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    tmp.replace(root / "latest")


def stale(steps: list[tuple[int, Path, bool]], keep: int, protected: set[Path]) -> list[Path]:
    """Keep-k: of the step folders `(step, folder, complete)` (oldest first), those to remove. The
    newest `keep` complete ones (0: all) and the `protected` ones stay; older complete ones go, and so
    do incomplete ones older than the newest complete (a newer one may be a save in flight)."""
    complete = [p for _, p, done in steps if done]
    if not complete:
        return []
    kept = set(complete[-keep:] if keep > 0 else complete) | protected
    newest = max(s for s, p, _ in steps if p == complete[-1])
    return [p for s, p, done in steps if p not in kept and (done or s < newest)]


def scan(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, resolved folder, complete) of every step folder under `root` (no symbolic links), oldest first."""
    return [(s, p.resolve(), (p / METADATA).is_file()) for s, p in list_steps(root)]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield
