"""Health checks on gloo ranks (hybrid/health.py): a slowed rank is named; replicas that drift apart stop the run.

- Straggler (dp2, then pp2·dp2): one rank sleeps in each of its forward steps, and its measured compute time
  holds those sleeps (a lower bound, whatever else runs on the machine). The check every 2 steps is fed made-up
  compute times, so its verdict does not hang on this machine's load: equal times for steps 1-2 (no warning),
  then 10× on the slowed rank for steps 3-4, which the check names (its coordinate) in one warning line and in
  `health/slowest_rank`, with the ratio those times make. Under pp2·dp2 the slowed rank is compared with the
  other rank of its stage (`_compare`, also on its own without processes).
- Divergence (tp2·dp2, with ZeRO-1 and overlapped parameter gathers, which the check waits for): after clean
  steps that pass the check, one element of a DP-replicated weight on one rank, and of a TP-replicated norm
  on one rank, is nudged; the next check raises ReplicaDivergence on every rank, naming the parameter, the
  group and the odd rank on the ranks of that group.

A 2-layer model; the dp2 run in one launch, the pp2·dp2 and tp2·dp2 runs in another (`launched`), every config
composed before the ranks fork.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import run_ranks
from pp_helpers import VOCAB, Case, layout_context, make_cfg
from test_dp import synthetic_corpus

from hybrid.compression.hooks import make_hook
from hybrid.health import ReplicaDivergence, _compare
from hybrid.parallel.context import Layout
from hybrid.trainer import Trainer, build_chunks

TIMEOUT = 240
SLEEP_S = 0.02  # per forward step of the slowed rank
FAST_S, SLOW_S = 0.1, 1.0  # made-up compute seconds per step handed to the check; SLOW_S: the slowed rank's, steps 3-4


SLOWED = ("health.straggler_every=2", "health.straggler_threshold=0.5")
CHECKED = ("health.divergence_every=2", "health.straggler_every=0")
PLAIN, ZERO = Case(tp=2, layers=2), Case(tp=2, zero=1, extra=("parallel.overlap_param_gather=true",), layers=2)
ZERO3 = Case(tp=2, zero=3, layers=2)  # the check gathers every parameter first
SLOW_CASES = {2: (Case(layers=2), 1), 4: (Case(pp=2, layers=2), 2)}  # world → (case, the slowed rank)


def health_cfg(case: Case, world: int, *extra: str) -> Any:
    return make_cfg(case, world, extra=["train.steps=8", *extra])


def _trainer(case: Case, world: int, lines: list[str], *extra: str) -> Trainer:
    cfg = health_cfg(case, world, *extra)
    ctx = layout_context(world, case)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"),
                   hook, state, log=lines.append)


def slowed(rank: int, world: int, case: Case, slow: int) -> dict[str, Any]:
    """Four steps checked every 2: rank `slow` sleeps in each forward step; the check gets made-up compute times
    (SLOW_S on rank `slow` after step 2, FAST_S otherwise) and this rank's measured ones are returned."""
    lines: list[str] = []
    trainer = _trainer(case, world, lines, *SLOWED)
    forwards, measured = [0], []
    step, check = trainer.forward_step, trainer.health.after_step

    def forward(*a: Any) -> Any:
        forwards[0] += 1
        if rank == slow:
            time.sleep(SLEEP_S)
        return step(*a)

    def after_step(n: int, busy_s: Callable[[], float]) -> None:
        measured.append(busy_s())
        check(n, lambda: SLOW_S if rank == slow and n > 2 else FAST_S)

    trainer.forward_step = forward  # type: ignore[method-assign]
    trainer.health.after_step = after_step  # type: ignore[method-assign]
    for _ in range(4):
        trainer.train_step()
    return {"record": trainer.health.record(), "lines": lines, "forwards": forwards[0], "busy": measured}


def runs(rank: int, world: int) -> dict[str, Any]:
    """Rank function: the slowed run of this world size; on 4 ranks also the drifted replicas."""
    out = {"slowed": slowed(rank, world, *SLOW_CASES[world])}
    if world == 4:
        out["drifted"] = drifted(rank, world)
    return out


@functools.cache
def launched(world: int) -> dict[str, list[Any]]:
    """run → its results by rank, from the one launch on `world` ranks (configs composed here first)."""
    torch.set_num_threads(1)
    health_cfg(SLOW_CASES[world][0], world, *SLOWED)
    if world == 4:
        for case in (PLAIN, ZERO, ZERO3):
            health_cfg(case, world, *CHECKED)
    results = run_ranks(runs, world, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in results[0]}


@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "pp2dp2"])
def test_a_slowed_rank_is_named(world: int) -> None:
    slow = SLOW_CASES[world][1]
    results = launched(world)["slowed"]
    per_step = results[slow]["forwards"] // 4
    assert per_step >= 1 and min(results[slow]["busy"]) >= per_step * SLEEP_S  # the sleeps are compute time
    for r in results:  # every rank gathered the same times: the slowed rank over the median of its group of two
        assert r["record"]["health/slowest_rank"] == slow
        assert r["record"]["health/straggler_ratio"] == pytest.approx(SLOW_S / ((SLOW_S + FAST_S) / 2))
    warnings = [line for line in results[0]["lines"] if "straggler" in line]
    assert len(warnings) == 1 and f"warning: straggler: rank {slow} (" in warnings[0], warnings
    assert "computed 1.82× the median" in warnings[0] and "over steps 3..4" in warnings[0], warnings
    print("\n" + warnings[0])


def test_a_rank_is_compared_with_its_stage_or_with_every_rank() -> None:
    """`_compare`: (time over its group's median, rank, median) of each group's slowest rank; the groups are the
    pipeline stages, or the whole world when each stage has one rank."""
    times = [1.0, 1.0, 3.0, 1.0]
    staged = SimpleNamespace(layout=Layout.create(4, pp=2))  # stages: ranks 0, 1 and ranks 2, 3
    assert _compare(times, staged) == [(1.0, 0, 1.0), (1.5, 2, 2.0)]  # type: ignore[arg-type]
    assert _compare(times, SimpleNamespace(layout=Layout.create(4))) == [(3.0, 2, 1.0)]  # type: ignore[arg-type]
    assert _compare([2.0, 1.0], SimpleNamespace(layout=Layout.create(2, pp=2))) == [(4 / 3, 0, 1.5)]  # type: ignore


def _run_checked(rank: int, world: int, case: Case, nudge: tuple[str, int] | None) -> str | None:
    """Train 4 steps checking every 2 (the check after step 2 passes); then nudge parameter `name` on rank
    `where` and check at once (a step later the nudge would have spread to other parameters); the error line."""
    trainer = _trainer(case, world, [], *CHECKED)
    for _ in range(4):
        trainer.train_step()
    if nudge and rank == nudge[1]:
        with torch.no_grad():
            dict(trainer.model[0].named_parameters())[nudge[0]].view(-1)[0] += 1e-3
    try:
        trainer.health.divergence(trainer.step)
    except ReplicaDivergence as e:
        return str(e)
    return None


def drifted(rank: int, world: int) -> dict[str, Any]:
    return {"dp": _run_checked(rank, world, PLAIN, ("layers.1.mlp.up.weight", 3)),
            "tp": _run_checked(rank, world, PLAIN, ("layers.0.attn_norm.weight", 1)),
            "clean": _run_checked(rank, world, ZERO, None), "clean3": _run_checked(rank, world, ZERO3, None)}


def test_a_drifted_replica_stops_the_run_naming_the_parameter() -> None:
    results = launched(4)["drifted"]
    # tp2·dp2: ranks 1 and 3 are one DP group (tp rank 1), ranks 0 and 1 one TP group (dp rank 0)
    for r in results:
        assert r["clean"] is None  # ZeRO-1's overlapped gathers are waited for: no false alarm
        assert r["clean3"] is None  # ZeRO-3's parameters are gathered for the check
        assert r["dp"] is not None and r["dp"].startswith("replica divergence after step 4: "), r["dp"]
        assert r["tp"] is not None and r["tp"].startswith("replica divergence after step 4: "), r["tp"]
    for rank in (1, 3):  # two replicas: which one drifted cannot be told
        assert "layers.1.mlp.up.weight differs over the dp group (ranks [1, 3]): no majority" in results[rank]["dp"]
    assert "found on another rank" in results[0]["dp"]
    assert "layers.0.attn_norm.weight differs over the tp group (ranks [0, 1])" in results[0]["tp"], results[0]["tp"]
    print("\n" + results[3]["dp"] + "\n" + results[0]["tp"])


def test_fingerprints_see_a_flipped_bit_and_a_moved_element() -> None:
    from hybrid.health import _odd, fingerprint

    w = torch.randn(1000)
    flipped = w.clone()
    flipped.view(torch.int32)[123] ^= 1  # the last bit of one mantissa
    moved = w.clone()
    moved[[5, 6]] = moved[[6, 5]]
    assert torch.equal(fingerprint(w), fingerprint(w.clone()))
    assert not torch.equal(fingerprint(w), fingerprint(flipped))
    assert not torch.equal(fingerprint(w), fingerprint(moved))
    a, b = (1.0, 2.0), (1.0, 2.5)
    assert _odd([0, 1, 2, 3], [a, a, b, a]).startswith("rank(s) [2] hold other values")
    assert _odd([4, 6], [a, b]).startswith("no majority")
