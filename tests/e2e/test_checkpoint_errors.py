"""A checkpoint that cannot be resumed is bad input: `python -m hybrid.train checkpoint.resume=<path>`
exits 2 with one `hybrid: error:` line (one per rank under torchrun) naming the checkpoint and the
reason, no traceback, and writes nothing: the checkpoints (files, sizes, mtimes) and the run's
metrics.jsonl are as they were.

One single-process run (4 steps, checkpoints at 2 and 4) provides the checkpoints and the run folder;
each case resumes into a copy of that run folder, with the run's own checkpoint.dir. Every run is the real
entry point `hybrid.train.main` forked from the test process (hybrid.testing.cli_runs: `run_forked`, and
`run_forked_ranks` with torchrun's environment for the 2 ranks; tests/e2e/test_torchrun.py runs the real
torchrun for a refusal on every rank).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from test_nonfinite import frozen_gc
from test_rerun import env as env  # noqa: F401  (the shared fixture)
from test_torchrun import QUICK, ROOT

import hybrid.train
from hybrid.checkpoint import METADATA, step_path
from hybrid.testing.cli_runs import CliRun, run_forked, run_forked_ranks

RUN = "gpt-tiny-dp"
CONFIG = [*QUICK, "model.hidden=64", "model.n_layers=2", "train.steps=4", "train.eval_every=0",
          "checkpoint.every=2", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """A finished run: `<tmp>/ck/gpt-tiny-dp/step_000000{2,4}` and `<tmp>/run/metrics.jsonl` (steps 1..4)."""
    tmp = tmp_path_factory.mktemp("saved")
    r = train(tmp, tmp / "run", env)
    assert r.code == 0, r.stderr[-3000:]
    assert (step_path(tmp / "ck" / RUN, 4) / METADATA).is_file()
    return tmp


def train(tmp: Path, run_dir: Path, env: dict[str, str], *extra: str) -> CliRun:
    """`python -m hybrid.train` as a forked child of this process (hybrid.testing.cli_runs)."""
    argv = [*CONFIG, f"checkpoint.dir={tmp / 'ck'}", f"logging.dir={run_dir}", *extra]
    with frozen_gc():
        return run_forked(hybrid.train.main, argv, ROOT, env, timeout_s=180)


def snapshot(*roots: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `roots`: (size, mtime in ns, first bytes)."""
    out = {}
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                st = f.stat()
                out[str(f)] = (st.st_size, st.st_mtime_ns, f.read_bytes()[:4096])
    return out


def bad_copy(saved: Path, tmp: Path, kind: str) -> tuple[Path, list[str], str]:
    """(checkpoint path, extra overrides, expected reason) for one kind of bad checkpoint."""
    original = step_path(saved / "ck" / RUN, 4)
    copy = tmp / "copy" / "step_0000004"
    if kind in ("truncated", "unfinished", "zeroed"):
        shutil.copytree(original, copy)
    if kind == "shape":
        return original, ["model.hidden=128"], "holds another model shape (hidden=64 there, 128 here"
    if kind == "truncated":
        f = copy / "__0_0.distcp"
        size = f.stat().st_size
        f.write_bytes(f.read_bytes()[: size - 1000])
        return copy, [], f"is corrupt: shard file __0_0.distcp is truncated ({size - 1000} of {size} bytes)"
    if kind == "unfinished":
        (copy / METADATA).unlink()
        return copy, [], f"is incomplete: {METADATA} is missing (the save did not finish)"
    if kind == "zeroed":  # the right size, garbage inside: only reading it can tell (a run with steps left does)
        f = copy / "__0_0.distcp"
        f.write_bytes(bytes(f.stat().st_size))
        return copy, ["train.steps=6"], "could not be read"
    if kind == "missing":
        return tmp / "no" / "step_0000004", [], "does not exist"
    return saved / "run", [], "is not a hybrid checkpoint (hybrid.json is missing)"  # a run folder, not a checkpoint


def check_refused(r: CliRun, path: Path, reason: str, ranks: list[str]) -> None:
    """One `hybrid: error:` message per rank (of those whose output `r` holds) naming `path` and `reason`, no
    traceback before them. (Found in the text, not per line: the ranks' lines could interleave.)"""
    found = re.findall(r"(\[rank\d+\] )?hybrid: error: (.*?)(?=\[rank\d+\] hybrid: error: |\n|$)", r.stderr)
    assert sorted(prefix.strip() for prefix, _ in found) == ranks, r.stderr[-3000:]
    for _, message in found:
        assert str(path) in message and reason in message, message
    assert "Traceback" not in r.stderr.split("hybrid: error:")[0], r.stderr[-3000:]


KINDS = ["shape", "truncated", "unfinished", "missing", "not a checkpoint", "zeroed"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(kind: str, saved: Path, tmp_path: Path,
                                                         env: dict[str, str]) -> None:
    path, extra, reason = bad_copy(saved, tmp_path, kind)
    run_dir = tmp_path / "run"
    shutil.copytree(saved / "run", run_dir)
    before = snapshot(saved / "ck", tmp_path / "copy", run_dir / "metrics.jsonl")
    r = train(saved, run_dir, env, f"checkpoint.resume={path}", *extra)
    assert r.code == 2, r.stderr[-3000:]
    check_refused(r, path, reason, [""])
    assert "Traceback" not in r.stderr
    assert snapshot(saved / "ck", tmp_path / "copy", run_dir / "metrics.jsonl") == before


def test_a_bad_checkpoint_on_two_ranks_is_one_line_per_rank(saved: Path, tmp_path: Path,
                                                             env: dict[str, str]) -> None:
    path, _, reason = bad_copy(saved, tmp_path, "truncated")
    before = snapshot(saved / "ck", tmp_path / "copy")
    argv = [*CONFIG, f"checkpoint.dir={saved / 'ck'}", f"logging.dir={tmp_path / 'run'}", f"checkpoint.resume={path}"]
    with frozen_gc():
        ranks = run_forked_ranks(hybrid.train.main, argv, ROOT, 2, env, timeout_s=180)
    for rank, r in enumerate(ranks):
        assert r.code == 2, r.stderr[-3000:]
        check_refused(r, path, reason, [f"[rank{rank}]"])
    assert snapshot(saved / "ck", tmp_path / "copy") == before
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
