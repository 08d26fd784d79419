"""Fixtures the end-to-end modules share across the session: one data cache, and one uninterrupted 2-rank run
of `TINY` that several modules compare against (the fault-tolerance and save-on-signal resumes) or inspect (the
plain torchrun run's metrics), instead of each launching its own."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_torchrun import ROOT, TINY, read_metrics

REFERENCE_TIMEOUT_S = 240


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its folder (`run/`, `ck/`), step and eval records, and everything it printed."""

    tmp: Path
    steps: list[dict]
    evals: list[dict]
    out: str


@pytest.fixture(scope="session")
def e2e_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HYBRID_CACHE for every module: the caller's if set, else one fresh folder (the corpus is prepared once)."""
    return os.environ.get("HYBRID_CACHE") or str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory, e2e_cache: str) -> Reference:
    """`torchrun --nproc-per-node=2 -m hybrid.train TINY` (dp2, 8 steps, checkpoints 2, 4, 6, 8 with keep 2)."""
    tmp = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "hybrid.train",
           *TINY, f"checkpoint.dir={tmp / 'ck'}", f"logging.dir={tmp / 'run'}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=REFERENCE_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, evals = read_metrics(tmp / "run")
    return Reference(tmp, steps, evals, r.stdout + r.stderr)
