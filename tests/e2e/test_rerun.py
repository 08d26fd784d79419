"""Running again: a sweep's jobs each get their own folder, and a re-run with `checkpoint.resume=auto`
either continues, has nothing to do, or refuses changed training settings — never trains nothing
silently, never rewrites what an earlier run logged.

Single-process `python -m hybrid.train` runs with the working directory in a temporary folder, so
the default places (`runs/`, `checkpoints/`, `multirun/`) are what is tested; one 2-rank run checks that
a refusal is one line on every rank. Every run is the real entry point `hybrid.train.main` in children
forked from the test process (hybrid.testing.cli_runs: `run_forked`, and `run_forked_ranks` with
torchrun's environment for the ranks), on the default corpus the other end-to-end modules use.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_nonfinite import frozen_gc, load_what_runs_load
from test_torchrun import QUICK

import hybrid.train
from hybrid.checkpoint import MANIFEST, METADATA, read_manifest, run_root, step_path
from hybrid.config import compose_config
from hybrid.optim import lr_at
from hybrid.testing.cli_runs import CliRun, run_forked, run_forked_ranks

SMALL = [*QUICK, "model.hidden=64", "model.n_layers=2", "train.eval_every=0"]
TIMEOUT = 180


@pytest.fixture(scope="module")
def env(e2e_cache: str) -> dict[str, str]:
    """The environment of the runs (one thread, the session's data cache), and this process made ready to
    fork them (test_nonfinite's `load_what_runs_load`)."""
    load_what_runs_load()
    return {"OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache}


def launched(main: Callable[[], None]) -> Callable[[], None]:
    """`main` in a process whose `sys.orig_argv` is a torchrun rank's (`python -u -m hybrid.train <args>`): what
    train.log's first line records (hybrid.record.runlog.command_line); a fork's own is pytest's."""
    def rank() -> None:
        sys.orig_argv = [sys.executable, "-u", "-m", "hybrid.train", *sys.argv[1:]]
        main()
    return rank


def train(cwd: Path, env: dict[str, str], *args: str) -> CliRun:
    """`python -m hybrid.train args` in `cwd`, as a forked child of this process (hybrid.testing.cli_runs: the
    same entry point, without the imports)."""
    with frozen_gc():
        return run_forked(hybrid.train.main, list(args), cwd, env, timeout_s=TIMEOUT)


def train_ranks(cwd: Path, env: dict[str, str], *args: str, world: int = 2) -> list[CliRun]:
    """`hybrid.train args` as the `world` ranks of one run in `cwd` (forked, torchrun's environment and
    command line); their results by rank."""
    with frozen_gc():
        return run_forked_ranks(launched(hybrid.train.main), list(args), cwd, world, env, timeout_s=TIMEOUT)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_lr(cfg_overrides: list[str], step: int) -> float:
    """The LR the run's schedule gives step `step` (counted from 1): hybrid.optim.lr_at on the composed config."""
    cfg = compose_config(cfg_overrides)
    return lr_at(step - 1, cfg.train.lr, cfg.train.steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio)


def test_each_sweep_job_gets_its_own_run_folder_and_checkpoints(tmp_path: Path, env: dict[str, str]) -> None:
    base = [*SMALL, "train.steps=2", "checkpoint.every=1"]
    r = train(tmp_path, env, "-m", *base, "train.lr=1e-3,3e-3")
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = tmp_path / "multirun" / compose_config(base).run_name
    jobs = sorted(p.parent for p in sweep.glob("*/metrics.jsonl"))
    assert len(jobs) == 2
    checkpoints, lrs = set(), set()
    for job in jobs:
        lr = float(re.findall(r"train\.lr=([\d.e-]+)", (job / ".hydra" / "overrides.yaml").read_text())[-1])
        lrs.add(lr)
        job_cfg = [*base, f"train.lr={lr}"]
        assert [(m["step"], m["lr"]) for m in rows(job)] == [(s, expected_lr(job_cfg, s)) for s in (1, 2)]
        root = run_root(compose_config([*job_cfg, f"checkpoint.dir={job / 'checkpoints'}"]))
        for step in (1, 2):
            assert (step_path(root, step) / METADATA).is_file()
            assert read_manifest(step_path(root, step))["config"]["train"]["lr"] == lr
        checkpoints.add(root.resolve())
    assert len(checkpoints) == 2 and lrs == {1e-3, 3e-3}
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for root in roots for f in sorted(root.rglob("*"))
            if f.is_file()}


def errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "hybrid: error:" in ln]


def test_a_rerun_continues_refuses_or_has_nothing_to_do(tmp_path: Path, env: dict[str, str]) -> None:
    first = [*SMALL, "train.steps=2", "checkpoint.every=2"]
    r = train(tmp_path, env, *first)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = compose_config(first)
    run_dir, ck = tmp_path / cfg.logging.dir, tmp_path / run_root(cfg)
    assert (step_path(ck, 2) / MANIFEST).is_file()
    logged, before = (run_dir / "metrics.jsonl").read_bytes(), snapshot(ck, run_dir / "metrics.jsonl")

    changed = [*first, "train.lr=1e-3", "checkpoint.resume=auto"]  # another LR: refused, nothing written
    r = train(tmp_path, env, *changed)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(errors(r.stderr)) == 1 and "Traceback" not in r.stderr
    assert "train.lr" in errors(r.stderr)[0] and "checkpoint.allow_changes=true" in errors(r.stderr)[0]
    assert snapshot(ck, run_dir / "metrics.jsonl") == before

    ranks = train_ranks(tmp_path, env, *changed)  # the same refusal on every rank (another dp: allowed)
    for rank, r in enumerate(ranks):
        assert r.code == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert len(errors(r.stderr)) == 1 and errors(r.stderr)[0].startswith(f"[rank{rank}] "), r.stderr[-3000:]
        assert "train.lr" in errors(r.stderr)[0] and "allow_changes" in errors(r.stderr)[0]
    assert snapshot(ck, run_dir / "metrics.jsonl") == before

    r = train(tmp_path, env, *first, "checkpoint.resume=auto")  # the same run again: finished
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ln for ln in r.stderr.splitlines() if "nothing to do" in ln] == [
        f"hybrid: nothing to do: {step_path(run_root(cfg), 2)} is at step 2 = train.steps; raise train.steps to "
        "train longer, or checkpoint.resume=none / another run_name to start fresh"]
    assert snapshot(ck, run_dir / "metrics.jsonl") == before

    longer = [*changed, "checkpoint.allow_changes=true", "train.steps=3"]  # accepted: trains step 3 only
    r = train(tmp_path, env, *longer)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(logged)
    assert [(m["step"], m["lr"]) for m in rows(run_dir)][2:] == [(3, expected_lr(longer, 3))]
    assert (step_path(ck, 3) / METADATA).is_file()
