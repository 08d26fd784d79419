"""scripts/gpu_session.sh's plumbing, with a stand-in Python (the real steps run tiny in `--dry-run`, and on a GPU
when one is lent): every step runs in order, the results come back as two files, a step that hangs is cut at the
script's budget and the steps after it are skipped with the command that runs them, bad usage is one line."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
STEPS = ["gpucheck", "vs_plain_loop", "gpucheck_llama", "tp_chunk_cost", "diagnose", "binding", "cp_kernels", "plan"]
STUB = """#!/usr/bin/env bash
for a in "$@"; do [[ -n "${FAKE_HANG:-}" && "$a" == *"$FAKE_HANG"* ]] && exec sleep 60; done
echo "ran $*"
"""


def session(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "py"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(stub), **env})


def bundled(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / "session.tgz") as tar:
        return {Path(n).name for n in tar.getnames() if n.endswith(".txt")}


def test_every_step_runs_in_order_and_comes_back_as_two_files(tmp_path: Path) -> None:
    done = session(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["session.log", "session.tgz"]
    assert bundled(tmp_path) == {f"{s}.txt" for s in STEPS}
    log = (tmp_path / "out" / "session.log").read_text()
    started = [line.split()[1] for line in log.splitlines() if " limit " in line]
    assert started == STEPS and "failed: none; skipped: none" in log


def test_a_hung_step_is_cut_at_the_budget_and_the_rest_skipped_with_their_command(tmp_path: Path) -> None:
    """The first step sleeps 60 s; a 9 s budget (5 of them kept for packing) cuts it at 4 s (3 when the script's
    whole-second clock ticks before it starts) and leaves no 2 s for any other step."""
    done = session(tmp_path, "--dry-run", "--budget", "9", FAKE_HANG="gpucheck", GPU_SESSION_MIN_S="2")
    assert done.returncode == 1
    log = (tmp_path / "out" / "session.log").read_text()
    assert re.search(r"gpucheck FAILED \(status 124: over its [34]s\)", log), log
    skipped = [line.split()[1] for line in log.splitlines() if "SKIPPED" in line]
    assert skipped == STEPS[1:]
    assert f"--dry-run --steps {','.join(STEPS[1:])}" in log
    assert bundled(tmp_path) == {"gpucheck.txt"}


def test_a_chosen_subset_runs_alone(tmp_path: Path) -> None:
    done = session(tmp_path, "--dry-run", "--steps", "plan,diagnose")
    assert done.returncode == 0 and bundled(tmp_path) == {"plan.txt", "diagnose.txt"}


@pytest.mark.parametrize("args, says", [(["--steps", "gpucheck,nope"], "unknown step 'nope'"),
                                        (["--budget", "soon"], "--budget takes whole seconds"),
                                        (["--fast"], "unknown argument '--fast'")])
def test_bad_usage_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    done = session(tmp_path, *args)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"gpu_session: {says} (usage: ")
