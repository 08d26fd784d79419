"""PowerSGD's adaptive rank on 2 gloo ranks, through the hook as `GradSync` runs it.

- gradients whose DP mean has rank 2 (a basis every rank shares): from rank 4 the ranks settle at 2, every
  output is the exact mean, and both ranks decide alike;
- full-rank noise: the ranks grow, never past the byte budget, and every step's counted bytes equal
  `powersgd.payload_bytes` at that step's ranks; with bf16 factors (2 bytes an element) the same budget
  affords higher ranks;
- the probe's error estimate against the exact error of the same steps (without error feedback the
  approximated matrix is the plain mean, so the test computes it);
- a resume mid-window from `state_dict` continues bit for bit as the uninterrupted run;
- started from the exact warm-up's last mean (`start.py`): a rank-3 mean starts compressed at rank 3, exactly,
  where a cold start runs its first window at rank 2; a fixed rank's first compressed step is the best rank-2
  approximation of a rank-3 mean (Eckart–Young), a cold start's random Q falls short of it;
- a run of RUN steps with its warm-up sized from the run (one exact step): the budget is over the run, so the
  compressed steps keep `defaults.bucket_ratio` and the run, its fp32 warm-up step included, sends
  `compression.min_ratio` × fewer bytes than exact.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from hybrid.compression import powersgd
from hybrid.compression.defaults import bucket_ratio
from hybrid.compression.hooks import make_hook
from hybrid.config import CompressionConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.dp.buckets import GradBucket

SHAPES = [(64, 48), (48,), (32, 96), (100, 3)]  # tall, a bias, wide (the probe's other side), sent exactly
MATS = [(64, 48), (32, 96)]  # the ones compressed at rank 4
RANK, MIN_RATE, TIMEOUT = 4, 2.0, 120
RUN = 40  # the run-level budget's run: 1 exact step (1 % of 40, at least one), then 39 compressed


def cfg(**kw: object) -> CompressionConfig:
    base = {"method": "powersgd", "rank": RANK, "rank_window": 3, "target_error": 0.3, "min_ratio": 4.0,
            "factor_dtype": "fp32"}
    return CompressionConfig(**{**base, **kw})  # type: ignore[arg-type]


def gradient(rank: int, step: int, low: int) -> torch.Tensor:
    """Rank `rank`'s flat bucket at `step`: with `low` > 0 each compressed matrix is U·Vᵢ with a U (rank `low`)
    shared by every rank (so the mean has rank `low`), else noise."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    parts = []
    for i, s in enumerate(SHAPES):
        if low and s in MATS:
            u = torch.randn(s[0], low, generator=torch.Generator().manual_seed(100 + i))
            parts.append((u @ torch.randn(low, s[1], generator=gen)).reshape(-1))
        else:
            parts.append(torch.randn(math.prod(s), generator=gen))
    return torch.cat(parts)


def run(state: object, hook: object, rank: int, steps: range, low: int) -> list[dict]:
    """One bucket per step through the hook: its output, counted bytes, the exact mean, the ranks used."""
    out = []
    for t in steps:
        buf = gradient(rank, t, low)
        mean = buf.clone()
        dist.all_reduce(mean)
        used = list(state.state.ranks(0, MATS))
        C.COUNTER.reset()
        bucket = GradBucket(0, buf.clone(), [nn.Parameter(torch.empty(s)) for s in SHAPES], True)
        value = hook(state, bucket).wait()
        counted = C.COUNTER.group_bytes(C.group_name(dist.group.WORLD))
        out.append({"out": value.clone(), "bytes": counted, "ranks": used, "mean": mean / 2})
    return out


def worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    res = {}
    hook, state = make_hook(cfg(error_feedback=False), group)
    res["low"] = (run(state, hook, rank, range(24), low=2), state.state.control.ranks[0])
    hook, state = make_hook(cfg(), group)
    res["noise"] = (run(state, hook, rank, range(12), low=0), state.state.control.ranks[0])
    hook, state = make_hook(cfg(factor_dtype="bf16"), group)
    res["noise_bf16"] = (run(state, hook, rank, range(12), low=0), state.state.control.ranks[0])
    hook, state = make_hook(cfg(error_feedback=False, target_error=0.99, rank_window=20), group)
    res["estimate"] = (run(state, hook, rank, range(20), low=0), state.state.control.errors[0])
    res["resume"] = resume(rank, group)
    for name, warm in (("started", 1), ("cold", 0)):  # the ranks from the warm-up's exact mean, or from 2
        hook, state = make_hook(cfg(rank=2, target_error=0.05, warmup_steps=warm), group)
        res[name] = run(state, hook, rank, range(4), low=3)[warm:]  # the compressed steps
        hook, state = make_hook(cfg(rank=2, target_error=0.0, warmup_steps=warm), group)
        res[f"{name}_fixed"] = run(state, hook, rank, [5] * (warm + 1), low=3)[-1]  # one gradient twice
    hook, state = make_hook(cfg(), group, steps=RUN)
    res["run"] = (run(state, hook, rank, range(RUN), low=0), state.state.control.min_ratio)
    return res


def resume(rank: int, group: object) -> tuple[list, list]:
    """8 steps straight, and 5 steps + a fresh state loaded from `state_dict` + 3 steps."""
    hook, state = make_hook(cfg(rank_window=4), group)
    straight = run(state, hook, rank, range(8), low=0)
    hook, first = make_hook(cfg(rank_window=4), group)
    run(first, hook, rank, range(5), low=0)
    hook, second = make_hook(cfg(rank_window=4), group)
    second.load_state_dict(first.state_dict())
    return straight[5:], run(second, hook, rank, range(5, 8), low=0)


@functools.cache
def results() -> list[dict]:
    return run_ranks(worker, 2, timeout=TIMEOUT)


def offsets() -> list[tuple[int, int]]:
    starts = [0, *itertools.accumulate(math.prod(s) for s in SHAPES)]
    return [(starts[i], starts[i + 1]) for i in range(len(SHAPES))]


def test_a_rank_two_mean_settles_at_rank_two_exactly_on_both_ranks() -> None:
    (steps0, ranks0), (steps1, ranks1) = results()[0]["low"], results()[1]["low"]
    assert ranks0 == ranks1 == [2, 2]
    assert [s["ranks"] for s in steps0] == [s["ranks"] for s in steps1]
    for s in steps0:
        torch.testing.assert_close(s["out"], s["mean"], rtol=1e-3, atol=1e-3)  # fp32 QR of a rank-2 sum


def test_noise_grows_the_ranks_within_the_budget_and_bytes_follow_the_formula() -> None:
    steps, final = results()[0]["noise"]
    assert max(final) > RANK
    budget = sum(math.prod(s) for s in SHAPES) / 4.0
    sizes = [torch.Size(s) for s in SHAPES]
    for s in steps:
        assert s["bytes"] == powersgd.payload_bytes(sizes, RANK, MIN_RATE, ranks=s["ranks"], probed=True)
        assert s["bytes"] <= 4 * budget or s["ranks"] == [RANK, RANK]
    assert [s["ranks"] for s in steps] == [s["ranks"] for s in results()[1]["noise"][0]]


def test_bf16_factors_grow_higher_ranks_within_the_same_byte_budget() -> None:
    steps, final = results()[0]["noise_bf16"]
    budget_bytes = 4 * sum(math.prod(s) for s in SHAPES) / 4.0
    sizes = [torch.Size(s) for s in SHAPES]
    for s in steps:
        assert s["bytes"] == powersgd.payload_bytes(sizes, RANK, MIN_RATE, ranks=s["ranks"], probed=True,
                                                    factor_bytes=2)
        assert s["bytes"] <= budget_bytes or s["ranks"] == [RANK, RANK]
    assert sum(final) > sum(results()[0]["noise"][1])
    assert [s["ranks"] for s in steps] == [s["ranks"] for s in results()[1]["noise_bf16"][0]]


def test_the_probe_estimates_the_exact_error_of_each_matrix() -> None:
    steps, estimated = results()[0]["estimate"]
    spans = [offsets()[SHAPES.index(m)] for m in MATS]
    for (a, b), guess in zip(spans, estimated):
        err = sum(float((s["out"][a:b] - s["mean"][a:b]).pow(2).sum()) for s in steps)
        ref = sum(float(s["mean"][a:b].pow(2).sum()) for s in steps)
        assert guess == pytest.approx(math.sqrt(err / ref), rel=0.25)


def test_a_resume_mid_window_continues_bit_for_bit() -> None:
    for straight, resumed in (r["resume"] for r in results()):
        for a, b in zip(straight, resumed):
            assert a["ranks"] == b["ranks"] and a["bytes"] == b["bytes"]
            torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0)


def test_a_run_with_its_warm_up_sends_min_ratio_times_fewer_bytes() -> None:
    steps, per_bucket = results()[0]["run"]
    assert per_bucket == bucket_ratio(cfg(), RUN) == pytest.approx((1 - 1 / RUN) / (1 / 4.0 - 1 / RUN))
    exact = sum(math.prod(s) for s in SHAPES) * 4  # the fp32 all-reduce's counted bytes
    assert steps[0]["bytes"] == exact and all(s["bytes"] < exact for s in steps[1:])
    assert all(s["bytes"] <= exact / per_bucket for s in steps[1:])  # every compressed step within its budget
    ratio = RUN * exact / sum(s["bytes"] for s in steps)
    assert ratio >= 4.0


def test_the_exact_warm_up_starts_the_ranks_where_the_mean_needs_them() -> None:
    started, cold = results()[0]["started"], results()[0]["cold"]
    assert started[0]["ranks"] == [3, 3] and cold[0]["ranks"] == [2, 2]
    for s in started:
        torch.testing.assert_close(s["out"], s["mean"], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(cold[0]["out"], cold[0]["mean"], rtol=1e-3, atol=1e-3)
    assert [s["ranks"] for s in started] == [s["ranks"] for s in results()[1]["started"]]


def test_a_fixed_rank_starts_from_the_mean_s_leading_singular_vectors() -> None:
    for r in results():
        warm, cold = r["started_fixed"], r["cold_fixed"]
        for m in MATS:
            a, b = offsets()[SHAPES.index(m)]
            mean = warm["mean"][a:b].view(m)
            u, sv, vh = torch.linalg.svd(mean, full_matrices=False)
            best = (u[:, :2] * sv[:2]) @ vh[:2]
            torch.testing.assert_close(warm["out"][a:b].view(m), best, rtol=1e-4, atol=1e-4)
            assert float((cold["out"][a:b].view(m) - mean).norm()) > 1.01 * float((best - mean).norm())
