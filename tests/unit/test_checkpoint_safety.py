"""What a checkpoint folder may hold and what is removed (hybrid.checkpoint.trust): a crafted DCP index or
blob runs no code, a folder another user could have written is not resumed, a symbolic link is never
followed by the cleanup, run_name cannot climb out of checkpoint.dir, and a diverged (non-finite) run
keeps its last finite checkpoint and says so (one line, exit 1) — the last through the real command line.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import hybrid.train
from hybrid.checkpoint import MANIFEST, METADATA, find_latest, problem, step_path
from hybrid.checkpoint.files import scan
from hybrid.checkpoint.state import blob, unblob
from hybrid.checkpoint.trust import remove_step
from hybrid.config import ConfigError, compose_config
from hybrid.testing.cli_runs import run_forked
from hybrid.validation import validate

B = ["model=gpt-tiny", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
     "logging.wandb.mode=disabled", "logging.progress=false"]


class _Payload:
    """Unpickling this creates `marker`: what a planted pickle could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def planted(root: Path, step: int, marker: Path) -> Path:
    """A step folder that looks complete (manifest, index) but whose index is a crafted pickle."""
    path = step_path(root, step)
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": 1, "step": step}))
    (path / METADATA).write_bytes(pickle.dumps(_Payload(marker)))
    return path


def test_a_crafted_index_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the reference: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    path = planted(tmp_path / "run", 3, marker)
    why = problem(path)
    assert why is not None and "posix.system is not part of a checkpoint index" in why
    warned: list[str] = []
    assert find_latest(tmp_path / "run", warned.append) is None
    assert len(warned) == 1 and "skipping it" in warned[0]
    assert not marker.exists()


def test_a_crafted_blob_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    state = {"cpu": torch.get_rng_state(), "tp": [{"seed": 3, "offset": torch.tensor(5)}]}
    loaded = unblob(blob(state))  # our own blobs (RNG streams, hook state) round-trip
    assert torch.equal(loaded["cpu"], state["cpu"]) and loaded["tp"][0]["seed"] == 3
    with pytest.raises(pickle.UnpicklingError):
        unblob(blob({"x": _Payload(marker)}))
    assert not marker.exists()


def test_a_folder_others_could_write_is_not_resumed(tmp_path: Path) -> None:
    path = planted(tmp_path / "run", 3, tmp_path / "ran")
    path.chmod(0o777)
    assert "is writable by every user" in (problem(path) or "")
    path.chmod(0o755)
    if os.getuid() == 0:  # root can give it away: another owner
        os.chown(path / METADATA, 4242, 4242)
        assert "is owned by uid 4242" in (problem(path) or "")


def test_cleanup_never_follows_a_symlink_or_leaves_the_run_folder(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    (outside / "sub").mkdir(parents=True)
    (outside / METADATA).write_text("x")
    root = tmp_path / "ck" / "run"
    root.mkdir(parents=True)
    link = step_path(root, 1)
    link.symlink_to(outside, target_is_directory=True)
    assert scan(root) == []  # keep-k does not see it
    assert remove_step(root.parent / "elsewhere", root) is None  # nothing there: nothing to do
    (root.parent / "elsewhere").mkdir()
    assert "is not a step folder inside" in (remove_step(root.parent / "elsewhere", root) or "")
    assert remove_step(link, root) is None  # a save over step 1 unlinks the link itself
    assert not link.exists() and (outside / "sub").is_dir() and (root.parent / "elsewhere").is_dir()


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", ""])
def test_run_name_cannot_leave_its_folder(name: str) -> None:
    cfg = compose_config(B)  # composed once (every call a copy); run_name set as an override would set it
    cfg.run_name = name
    with pytest.raises(ConfigError, match="must be one folder name"):
        validate(cfg, 1)


def test_a_diverged_run_keeps_its_finite_checkpoint_and_says_so(tmp_path: Path) -> None:
    """The real command line (`hybrid.train`'s entry point in a forked child, hybrid.testing.cli_runs): lr 1e3
    diverges within a few steps and the first non-finite gradient stops it (train.on_nonfinite=stop) before any
    update; the symlinked step 1 points outside."""
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / METADATA).write_text("keep me")
    root = tmp_path / "ck" / "nan"
    root.mkdir(parents=True)
    step_path(root, 1).symlink_to(outside, target_is_directory=True)
    argv = [*B, "data.max_chars=200000", "parallel=single", "train.steps=8", "train.lr=1e3", "optim.warmup_steps=6",
            "checkpoint.every=2", "checkpoint.keep=1", "run_name=nan", f"checkpoint.dir={tmp_path / 'ck'}",
            f"logging.dir={tmp_path / 'run'}"]
    p = run_forked(hybrid.train.main, argv, tmp_path, {"OMP_NUM_THREADS": "1"}, timeout_s=240)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and errors[0].startswith("hybrid: error: step ") and "is kept" in errors[0]
    assert "the gradient is not finite" in errors[0] and "(train.on_nonfinite=stop;" in errors[0]  # stopped before
    kept = [s for s, _, done in scan(root) if done]
    assert kept and all(problem(step_path(root, s)) is None for s in kept)  # finite, complete: resumable
    assert f"({step_path(root, kept[-1]).resolve()})" in errors[0]
    dcp_to_torch_save(step_path(root, kept[-1]), tmp_path / "kept.pt")  # the reference: DCP's own reader
    tensors = [v for v in torch.load(tmp_path / "kept.pt").values() if isinstance(v, torch.Tensor)]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors)
    assert (outside / METADATA).read_text() == "keep me" and step_path(root, 1).is_symlink()
