"""A step that logs, saves and ends nothing reads nothing from the device: counted per step by
`hybrid.record.host_syncs.HostSyncs` (every tensor read into Python, every explicit synchronisation) on one
process and on 4 ranks (pp2dp2 with ZeRO-1, tp2dp2 with sequence parallelism), with `logging.log_every=2`
over 4 steps. The logged steps read (the counter sees them: it is not blind), and the run is bit-identical
to the same run reading every step (`logging.log_every=1`): deferring the reads changes no number.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from harness import run_ranks
from pp_helpers import VOCAB, Case, layout_context, make_cfg
from test_dp import synthetic_corpus

from hybrid.compression.hooks import make_hook
from hybrid.record.host_syncs import HostSyncs
from hybrid.trainer import Trainer, build_chunks

TIMEOUT = 240
STEPS, EVERY = 4, 2
CASES = {1: (Case(layers=2),), 4: (Case(pp=2, zero=1, layers=2), Case(tp=2, sp=True, layers=2))}


def cfg_of(case: Case, world: int, every: int, folder: str) -> Any:
    return make_cfg(case, world, extra=[f"train.steps={STEPS}", f"logging.log_every={every}",
                                        f"logging.dir={folder}/{case}-{every}", "logging.timing=false"])


def counted(case: Case, world: int, every: int, folder: str) -> dict[str, Any]:
    """Train `case` with every read counted against the step running it; the counts and the final weights."""
    cfg = cfg_of(case, world, every, folder)
    ctx = layout_context(world, case)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"),
                      hook, state, log=lambda line: None)
    trainer.start()
    syncs, before = HostSyncs(), trainer.profiler.before_step

    def at(step: int) -> None:
        syncs.at = step
        before(step)

    trainer.profiler.before_step = at  # type: ignore[method-assign]
    with syncs.counting():
        trainer.fit()
    trainer.close()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    return {"by_step": dict(syncs.by_step), "where": {s: dict(c) for s, c in syncs.where.items()}, "weights": weights}


def runs(rank: int, world: int, folder: str) -> list[dict[str, Any]]:
    """Rank function: each case of this world size, reading every EVERY steps and every step."""
    return [{every: counted(case, world, every, folder) for every in (EVERY, 1)} for case in CASES[world]]


@functools.cache
def launched(world: int, folder: str) -> list[list[dict[str, Any]]]:
    """Per rank, per case: {log_every: counts and weights}; configs composed here before the ranks fork."""
    for case in CASES[world]:
        for every in (EVERY, 1):
            cfg_of(case, world, every, folder)
    if world == 1:
        return [runs(0, 1, folder)]
    return run_ranks(runs, world, folder, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("syncs"))


@pytest.mark.parametrize("world", [1, 4])
def test_steps_that_log_nothing_read_nothing(world: int, folder: str) -> None:
    for rank, cases in enumerate(launched(world, folder)):
        for case, result in zip(CASES[world], cases):
            by_step = result[EVERY]["by_step"]
            quiet = {s: result[EVERY]["where"].get(s) for s in range(1, STEPS + 1) if s % EVERY and by_step.get(s)}
            assert not quiet, f"rank {rank} {case}: host reads on steps that log nothing: {quiet}"
            assert all(by_step.get(s, 0) > 0 for s in range(EVERY, STEPS + 1, EVERY)), (rank, case, by_step)


@pytest.mark.parametrize("world", [1, 4])
def test_reading_late_changes_no_number(world: int, folder: str) -> None:
    for cases in launched(world, folder):
        for result in cases:
            for late, every_step in zip(result[EVERY]["weights"], result[1]["weights"], strict=True):
                torch.testing.assert_close(late, every_step, rtol=0, atol=0)
