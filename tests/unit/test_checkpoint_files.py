"""Checkpoint folders without process groups: `problem()` for each way a folder can fail to be a
checkpoint, `find_latest` skipping (and warning about) incomplete or corrupt ones, `resolve_resume`
for none / auto / a checkpoint / a run folder, and the keep-k rule (`stale`, and `Checkpointer.cleanup`
removing what it names).

The checkpoints are real DCP saves of two small tensors plus a manifest (`problem()` reads DCP's
index and the shard sizes, never the model); cleanup only looks at `.metadata`, so its folders are
empty step folders with or without that file.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from hybrid.checkpoint import (
    FORMAT,
    MANIFEST,
    METADATA,
    Checkpointer,
    CheckpointError,
    find_latest,
    list_steps,
    problem,
    resolve_resume,
    stale,
    step_path,
)
from hybrid.parallel.context import ParallelContext

INCOMPLETE = f"is incomplete: {METADATA} is missing (the save did not finish)"


def save(path: Path, step: int = 1) -> Path:
    """A complete checkpoint folder: manifest, DCP shard file(s) and DCP's `.metadata`."""
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step}), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(256.0), "b": torch.ones(3)}, checkpoint_id=str(path), no_dist=True)
    return path


def shard(path: Path) -> Path:
    files = sorted(path.glob("*.distcp"))
    assert files, list(path.iterdir())
    return files[0]


def truncate(path: Path) -> Path:
    f = shard(path)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return path


def unfinished(path: Path) -> Path:
    (path / METADATA).unlink()
    return path


# ---- problem() ---------------------------------------------------------------------------------

def test_a_complete_checkpoint_has_no_problem(tmp_path: Path) -> None:
    assert problem(save(tmp_path / "step_0000001")) is None


def test_problem_names_each_failure(tmp_path: Path) -> None:
    assert problem(tmp_path / "nope") == "does not exist"
    (tmp_path / "file").write_text("x")
    assert problem(tmp_path / "file") == "is not a directory"
    (tmp_path / "empty").mkdir()
    assert problem(tmp_path / "empty") == f"is not a hybrid checkpoint ({MANIFEST} is missing)"
    (save(tmp_path / "plain") / MANIFEST).unlink()  # a DCP checkpoint, but not one of ours
    assert problem(tmp_path / "plain") == f"is not a hybrid checkpoint ({MANIFEST} is missing)"
    assert problem(unfinished(save(tmp_path / "partial"))) == INCOMPLETE


def test_problem_names_a_corrupt_index_or_shard(tmp_path: Path) -> None:
    garbage = save(tmp_path / "garbage")
    (garbage / METADATA).write_bytes(b"not a pickle")
    assert problem(garbage).startswith(f"is corrupt: cannot read its index {METADATA} (")
    manifest = save(tmp_path / "manifest")
    (manifest / MANIFEST).write_text("{", encoding="utf-8")  # a manifest cut short
    assert problem(manifest).startswith(f"is corrupt: cannot read its {MANIFEST} (JSONDecodeError: ")
    missing = save(tmp_path / "missing")
    name = shard(missing).name
    shard(missing).unlink()
    assert problem(missing) == f"is corrupt: shard file {name} is missing"
    short = save(tmp_path / "short")
    full = shard(short).stat().st_size
    truncate(short)
    assert problem(short) == f"is corrupt: shard file {name} is truncated ({full // 2} of {full} bytes)"


# ---- find_latest / list_steps ----------------------------------------------------------------------

def run_folder(root: Path) -> dict[int, Path]:
    """Steps 1, 2 complete; 3 truncated; 4 unfinished; plus things that are not step folders."""
    paths = {s: save(step_path(root, s), s) for s in (1, 2, 3, 4)}
    truncate(paths[3])
    unfinished(paths[4])
    (root / "latest").mkdir()
    (root / "step_0000009").write_text("a file, not a folder")
    (root / "step_12x").mkdir()
    return paths


def test_list_steps_lists_step_folders_oldest_first(tmp_path: Path) -> None:
    paths = run_folder(tmp_path)
    assert list_steps(tmp_path) == [(s, paths[s]) for s in (1, 2, 3, 4)]
    assert list_steps(tmp_path / "none") == []


def test_find_latest_skips_incomplete_and_corrupt_with_a_warning(tmp_path: Path) -> None:
    paths = run_folder(tmp_path)
    warned: list[str] = []
    assert find_latest(tmp_path, warned.append) == paths[2]
    assert warned == [f"warning: checkpoint {paths[4]} {INCOMPLETE}; skipping it",
                      f"warning: checkpoint {paths[3]} {problem(paths[3])}; skipping it"]
    assert "truncated" in warned[1]


def test_find_latest_finds_nothing_quietly(tmp_path: Path) -> None:
    warned: list[str] = []
    assert find_latest(tmp_path / "none", warned.append) is None
    assert find_latest(tmp_path, warned.append) is None
    unfinished(save(step_path(tmp_path, 5)))
    assert find_latest(tmp_path, warned.append) is None
    assert len(warned) == 1 and "skipping it" in warned[0]


# ---- resolve_resume ------------------------------------------------------------------------------

def cfg(root: Path, resume: Any, **checkpoint: Any) -> Any:
    c = {"dir": str(root), "resume": resume, "every": 1, "keep": 2, "async": False, **checkpoint}
    return OmegaConf.create({"run_name": "run", "train": {"steps": 10}, "checkpoint": c})


def resolve(root: Path, resume: Any) -> tuple[Optional[Path], list[str]]:
    warned: list[str] = []
    return resolve_resume(cfg(root, resume), warned.append), warned


def test_resume_none_and_auto(tmp_path: Path) -> None:
    assert resolve(tmp_path, "auto") == (None, [])  # a new run: nothing to resume
    paths = run_folder(tmp_path / "run")
    assert resolve(tmp_path, "none") == (None, [])  # never looks
    found, warned = resolve(tmp_path, "auto")
    assert found == paths[2] and len(warned) == 2


def test_resume_a_checkpoint_or_a_run_folder(tmp_path: Path) -> None:
    paths = run_folder(tmp_path / "other")
    assert resolve(tmp_path, str(paths[1])) == (paths[1], [])  # a named older one, as asked
    found, warned = resolve(tmp_path, str(tmp_path / "other"))
    assert found == paths[2] and len(warned) == 2


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "unfinished", "no complete one"])
def test_resume_a_bad_path_is_an_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / kind.replace(" ", "_")
    if kind == "empty":
        path.mkdir()
    elif kind in ("truncated", "unfinished"):
        (truncate if kind == "truncated" else unfinished)(save(path))
    elif kind == "no complete one":
        unfinished(save(step_path(path, 3)))
    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path, str(path))
    msg = str(e.value)
    assert msg.startswith("checkpoint.resume") and str(path) in msg and "\n" not in msg, msg
    want = {"missing": f"{path} does not exist", "empty": f"{path} is not a hybrid checkpoint",
            "truncated": f"{path} is corrupt: shard file", "unfinished": f"{path} {INCOMPLETE}",
            "no complete one": f"no complete checkpoint in {path}"}[kind]
    assert want in msg, msg


# ---- Checkpointer.cleanup ------------------------------------------------------------------------

def checkpointer(tmp_path: Path, keep: int, complete: list[int], partial: list[int]) -> tuple[Checkpointer, list]:
    """A Checkpointer of run `run` under `tmp_path` (keep `keep`) over fake step folders."""
    root = tmp_path / "run"
    for s in complete + partial:
        step_path(root, s).mkdir(parents=True)
        if s in complete:
            (step_path(root, s) / METADATA).write_bytes(b"")
    log: list[str] = []
    return Checkpointer(cfg(tmp_path, "none", keep=keep), ParallelContext.single(), torch.device("cpu"), {},
                        log=log.append), log


def left(c: Checkpointer) -> list[int]:
    return [s for s, _ in list_steps(c.root)]


def test_cleanup_keeps_the_newest_k(tmp_path: Path) -> None:
    c, log = checkpointer(tmp_path, 2, [1, 2, 3], [])
    c.cleanup()
    assert left(c) == [2, 3]
    assert log == [f"checkpoint: removed {step_path(c.root, 1)}"]
    c.cleanup()  # idempotent
    assert left(c) == [2, 3] and len(log) == 1


def test_cleanup_never_removes_the_checkpoint_resumed_from(tmp_path: Path) -> None:
    c, _ = checkpointer(tmp_path, 1, [1, 2, 3], [])
    c.protected.add(step_path(c.root, 1))
    c.cleanup()
    assert left(c) == [1, 3]


def test_cleanup_removes_stale_partial_folders_only(tmp_path: Path) -> None:
    """A partial folder older than the newest complete one is a dead save; a newer one may be a save in
    flight (or the next one's folder) and stays."""
    c, _ = checkpointer(tmp_path, 2, [2, 4], [1, 3, 5])
    c.cleanup()
    assert left(c) == [2, 4, 5]


def test_cleanup_keep_0_keeps_every_complete_one(tmp_path: Path) -> None:
    c, _ = checkpointer(tmp_path, 0, [1, 2, 3, 5], [4, 6])
    c.cleanup()
    assert left(c) == [1, 2, 3, 5, 6]


def test_cleanup_without_a_complete_checkpoint_removes_nothing(tmp_path: Path) -> None:
    c, log = checkpointer(tmp_path, 1, [], [1, 2])
    (c.root / "notes").mkdir()
    c.cleanup()
    assert left(c) == [1, 2] and log == []
    c, _ = checkpointer(tmp_path / "b", 5, [1, 2], [])
    c.cleanup()
    assert left(c) == [1, 2]
    assert (tmp_path / "run" / "notes").is_dir()


def test_cleanup_protects_the_resumed_checkpoint_however_it_was_spelled(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = Path("ck") / "run"
    for s in (1, 2, 3):
        step_path(root, s).mkdir(parents=True)
        (step_path(root, s) / METADATA).write_bytes(b"")
    c = Checkpointer(cfg(Path("ck"), "none", keep=1), ParallelContext.single(), torch.device("cpu"), {}, log=print)
    c.protected.add(step_path(root, 1).absolute())  # what checkpoint.resume=/abs/.../step_0000001 gives
    c.cleanup()
    assert left(c) == [1, 3]


def test_stale_is_the_keep_k_rule_on_step_listings() -> None:
    """The pure rule `Checkpointer.cleanup` applies: (step, folder, complete) in, folders to remove out."""
    steps = [(s, Path(f"s{s}"), done) for s, done in ((1, True), (2, False), (3, True), (4, True), (5, False))]
    assert stale(steps, 2, set()) == [Path("s1"), Path("s2")]
    assert stale(steps, 1, {Path("s1")}) == [Path("s2"), Path("s3")]
    assert stale(steps, 0, set()) == [Path("s2")]
    assert stale([(1, Path("s1"), False)], 1, set()) == []
