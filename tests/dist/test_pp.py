"""Pipeline parallelism (with TP, SP and DP) on gloo ranks against the single-process run.

Reference: the same config trained by one process (tp = pp = dp = 1) on the same global batch
split into the same microbatch size, so the same samples form the same microbatches. Every
layout trains the same model from the same initial weights (initialised by global parameter
name), so after 3 AdamW steps with clipping at 0.05 (active on every step) the losses, the
reported global gradient norms (the norm that was clipped by: a norm that double-counted a
TP-replicated or pipeline-duplicated parameter, or missed a stage, would differ) and the eval
loss match to fp32 round-off (rtol = atol = 1e-5; norms atol 1e-6), the weights to 1e-4 / 1e-5.
GPT ties its embeddings: the first stage's `tok_embed.weight` and the last stage's
`head.weight` (its `pp_duplicate`) must stay bit-identical and equal the reference embedding.

The layouts train several cases per launch (8-rank launches are the slow part); each launch
runs once per session (`launched`) and several tests read its results:
  - parity with the single-process run (losses, norms, weights, tied copies), and the parameter
    count summed over stages and TP shards (the tied head counted once) equals the analytic one,
  - the eval loss through the forward-only pipeline, on every rank,
  - changing only the schedule (gpipe ↔ 1f1b) leaves losses, norms and weights bit-identical
    (interleaving changes the partition into pp·v parts, so it is held to the reference only),
  - at dp > 1 every DP bucket's comm hook launched inside the backward, in index order, under
    every schedule,
  - the PP group's bytes per step equal `pp_bytes_per_step` on every rank, and the tied
    embedding's gradient all-reduce moves exactly the local embedding shard on the first and
    last stage (nothing elsewhere).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from harness import run_ranks
from pp_helpers import (
    LOSS_TOL,
    MICRO,
    SEQ,
    TIMEOUT,
    Case,
    assert_matches_reference,
    make_cfg,
    reference,
    track,
    train_cases,
)

from hybrid.model.traffic import pp_bytes_per_step

ALL = ("gpipe", "1f1b")


def cases(family: str, tp: int, pp: int, schedules: tuple[str, ...], sp: bool = False,
          interleaved: bool = False) -> list[Case]:
    out = [Case(family, tp, pp, s, 1, sp) for s in schedules]
    return out + ([Case(family, tp, pp, "interleaved", 2, sp)] if interleaved else [])


# name → (world, cases). Microbatches: 4 per step at dp=1, 2 at dp=2 (so no interleaving at pp4dp2).
LAUNCHES: dict[str, tuple[int, list[Case]]] = {
    "pp2": (2, cases("gpt", 1, 2, ALL, interleaved=True) + cases("llama", 1, 2, ALL)
            + [Case("gpt", 1, 2, "1f1b", extra=("train.recompute=full",))]),
    "pp4": (4, cases("llama", 1, 4, ALL, interleaved=True) + cases("gpt", 1, 4, ("1f1b",))
            + [Case("gpt", 1, 4, "1f1b", stage_layers=(0, 3, 5, 0))]),  # embedding-only and head-only stages
    "tp2pp2-sp": (4, cases("gpt", 2, 2, ALL, sp=True, interleaved=True) + cases("llama", 2, 2, ("1f1b",), sp=True)
                  + [Case("llama", 2, 2, "interleaved", 2, sp=True, extra=("train.recompute=selective",)),
                     Case("gpt", 2, 2, "1f1b", sp=True, extra=("train.recompute=full",))]),
    "tp2pp2dp2": (8, cases("gpt", 2, 2, ALL, interleaved=True)  # and the distributed optimizer (ZeRO-1):
                  + [Case("gpt", 2, 2, "1f1b", zero=1), Case("gpt", 2, 2, "interleaved", 2, zero=1)]),
    "tp1pp4dp2": (8, cases("llama", 1, 4, ALL)),
    "tp2pp4": (8, cases("gpt", 2, 4, ("1f1b",)) + cases("llama", 2, 4, (), interleaved=True)),
}
DP_LAUNCHES = ["tp2pp2dp2", "tp1pp4dp2"]
ERRORS: dict[str, float] = {}  # max |ours − reference| seen, by quantity (printed with -s)


@functools.cache
def launched(name: str) -> list[tuple[Case, list[dict[str, Any]]]]:
    """Every case of launch `name` with its results by rank (the launch runs once per session)."""
    torch.set_num_threads(1)
    world, launch_cases = LAUNCHES[name]
    results = run_ranks(train_cases, world, launch_cases, timeout=TIMEOUT)
    return [(c, [r[i] for r in results]) for i, c in enumerate(launch_cases)]


def schedule_pairs(name: str) -> list[tuple[Case, Case]]:
    """(gpipe, 1f1b) cases of launch `name` that differ only in the schedule."""
    launch_cases = LAUNCHES[name][1]
    return [(g, o) for g in launch_cases for o in launch_cases
            if g.schedule == "gpipe" and o.schedule == "1f1b"
            and (g.family, g.tp, g.pp, g.sp, g.zero, g.extra) == (o.family, o.tp, o.pp, o.sp, o.zero, o.extra)]


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_pipeline_matches_single_process(name: str) -> None:
    for case, results in launched(name):
        assert {r["case"] for r in results} == {str(case)}
        assert_matches_reference(results, reference(case.family), ERRORS)
    print(f"\nmax abs difference from the single-process run so far: {ERRORS}")


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_eval_through_the_pipeline_matches_single_process(name: str) -> None:
    for case, results in launched(name):
        ref = reference(case.family)["eval"]
        for r in results:  # computed on the last stage, broadcast over PP: every rank reports it
            torch.testing.assert_close(torch.tensor(r["eval"]), torch.tensor(ref), **LOSS_TOL,
                                       msg=lambda m, c=r["coord"], k=case: f"{k} eval at {c}: {m}")
            track(ERRORS, "eval", [r["eval"]], [ref])


@pytest.mark.parametrize("name", [n for n in LAUNCHES if schedule_pairs(n)])
def test_switching_gpipe_and_1f1b_is_bit_identical(name: str) -> None:
    results = {str(c): rs for c, rs in launched(name)}
    for gpipe, one_f in schedule_pairs(name):
        for a, b in zip(results[str(gpipe)], results[str(one_f)]):
            where = (str(one_f), a["coord"])
            assert a["losses"] == b["losses"], (where, a["losses"], b["losses"])
            assert a["norms"] == b["norms"], (where, a["norms"], b["norms"])
            assert a["eval"] == b["eval"], (where, a["eval"], b["eval"])
            if a["state"] is not None:
                for n, w in a["state"].items():
                    assert torch.equal(w, b["state"][n]), (where, n)


@pytest.mark.parametrize("name", DP_LAUNCHES)
def test_dp_buckets_launch_inside_the_backward_under_every_schedule(name: str) -> None:
    schedules = set()
    for case, results in launched(name):
        schedules.add(case.schedule)
        for r in results:
            assert r["buckets"] > 2, (str(case), r["coord"], r["buckets"])  # small bucket_mb: several buckets
            for step, log in enumerate(r["launch_logs"]):
                # every parameter of a stage gets a gradient, so every bucket must launch from the
                # gradient-ready hook while autograd runs (not from finish()), in index order
                assert [i for i, _ in log] == list(range(r["buckets"])), (str(case), r["coord"], step, log)
                assert all(inside for _, inside in log), (str(case), r["coord"], step, log)
    assert schedules >= {"gpipe", "1f1b"}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_pp_bytes_equal_the_analytic_figure(name: str) -> None:
    world = LAUNCHES[name][0]
    for case, results in launched(name):
        hidden = make_cfg(case, world).model.hidden
        for r in results:
            pp_rank = r["coord"][0]
            want = pp_bytes_per_step(MICRO, SEQ, hidden, case.tp, case.sp, r["microbatches"], case.pp, case.v, pp_rank)
            # the tied embedding (GPT): one all-reduce of this rank's shard per step, first and last stage only
            tied = case.family == "gpt" and pp_rank in (0, case.pp - 1)
            assert (r["tied_numel"] > 0) == tied, (str(case), r["coord"])
            embedding = {"all_reduce": 4 * r["tied_numel"]} if tied else {}
            for step, counted in enumerate(r["bytes"]):
                got = {op: b for (g, op), b in counted.items() if g == "pp"}
                assert got == want, (str(case), r["coord"], step, got, want)
                got = {op: b for (g, op), b in counted.items() if g == "embedding"}
                assert got == embedding, (str(case), r["coord"], step, got, embedding)
