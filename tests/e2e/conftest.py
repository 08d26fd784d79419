"""Fixtures the end-to-end modules share across the session: one data cache, this test process made ready to
fork ranks of the real entry point (`forking`), and one uninterrupted 2-rank run of `TINY` that several modules
compare against (the fault-tolerance and save-on-signal resumes) or inspect (the plain run's metrics), instead of
each launching its own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_torchrun import TINY, read_metrics

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
def forking(e2e_cache: str) -> dict[str, str]:
    """The environment of ranks forked from this process (`run_forked_ranks`), made ready for them: one torch
    thread, as a launched rank's OMP_NUM_THREADS=1 (the same floats as the launched runs), and loaded here, once,
    what every run would load (the trainer and with it DCP, which `hybrid.train` imports only once the run builds
    its trainer; transformers' tokenizer classes, AdamW's kernels and torch._dynamo, matplotlib's figure for the
    traffic map): the forked ranks inherit them instead of importing them again (seconds each)."""
    import torch
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    import hybrid.trainer  # noqa: F401

    torch.set_num_threads(1)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    return {"OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache}


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory, forking: dict[str, str]) -> Reference:
    """`hybrid.train TINY` as 2 ranks forked from this process (dp2, 8 steps, checkpoints 2, 4, 6, 8 with keep
    2): the same floats as the runs torchrun launches (the faulted and signalled ones compare bit for bit)."""
    import hybrid.train
    from hybrid.testing.cli_runs import run_forked_ranks

    tmp = tmp_path_factory.mktemp("reference")
    argv = [*TINY, f"checkpoint.dir={tmp / 'ck'}", f"logging.dir={tmp / 'run'}"]
    runs = run_forked_ranks(hybrid.train.main, argv, tmp, 2, forking, timeout_s=REFERENCE_TIMEOUT_S)
    assert [r.code for r in runs] == [0, 0], "\n".join(r.stderr[-3000:] for r in runs)
    steps, evals = read_metrics(tmp / "run")
    return Reference(tmp, steps, evals, "".join(r.stdout + r.stderr for r in runs))
