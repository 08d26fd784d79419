"""Pipeline parallelism (with TP, SP and DP) on gloo ranks against the single-process run.

Reference: the same config trained by one process (tp = pp = dp = 1) on the same global batch
split into the same microbatch size, so the same samples form the same microbatches (a 4-layer model
where the partition allows, a layer per part under TP, 8 layers for the 8-part pp4 × 2 virtual stages cases:
`smallest`). Every
layout trains the same model from the same initial weights (initialised by global parameter
name), so after 2 AdamW steps with clipping at 0.05 (active on every step) the losses, the
reported global gradient norms (the norm that was clipped by: a norm that double-counted a
TP-replicated or pipeline-duplicated parameter, or missed a stage, would differ) and the eval
loss match to fp32 round-off (rtol = atol = 1e-5; norms atol 1e-6), the weights to 1e-4 / 5e-5.
GPT ties its embeddings: the first stage's `tok_embed.weight` and the last stage's
`head.weight` (its `pp_duplicate`) must stay bit-identical and equal the reference embedding.

The named launches (layouts and their cases) are grouped by world size: one launch per world (2, 4
and 8 ranks) trains all of that world's cases in turn, once per session (`world_launch`), and several
tests read each named launch's results:
  - parity with the single-process run (losses, norms, weights, tied copies), and the parameter
    count summed over stages and TP shards (the tied head counted once) equals the analytic one,
  - the eval loss through the forward-only pipeline, on every rank,
  - changing only the schedule (gpipe, zb1p ↔ 1f1b) leaves losses, norms and weights bit-identical: the
    zero-bubble split backward computes the same gradients (interleaving and zbv change the partition into
    pp·v parts, so they are held to the reference only); also under int8 compression of the DP gradients,
  - at dp > 1 every DP bucket's comm hook launched inside the backward, in index order, under
    every schedule,
  - the PP group's bytes per step equal `pp_bytes_per_step` on every rank, and the tied
    embedding's gradient all-reduce moves exactly the local embedding shard on the first and
    last stage (nothing elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
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
from hybrid.parallel.dp.buckets import padded_numel
from hybrid.parallel.pp.actions import place_of
from hybrid.parallel.pp.schedules import SCHEDULES

ALL = ("gpipe", "1f1b")
BIT_IDENTICAL_TO_1F1B = ("gpipe", "zb1p")  # the same partition and the same per-chunk gradient order


def cases(family: str, tp: int, pp: int, schedules: tuple[str, ...], sp: bool = False,
          interleaved: bool = False) -> list[Case]:
    out = [Case(family, tp, pp, s, 1, sp) for s in schedules]
    return out + ([Case(family, tp, pp, "interleaved", 2, sp)] if interleaved else [])


OWN = "parallel.zb_memory=none"  # the schedule's own weight-pass deferrals (default: what fits 1F1B's memory)


def zero_bubble(family: str, tp: int, pp: int, sp: bool = False, fitted: bool = False) -> list[Case]:
    extra = () if fitted else (OWN,)
    return [Case(family, tp, pp, "zb1p", 1, sp, extra=extra), Case(family, tp, pp, "zbv", 2, sp, extra=extra)]


COMPRESSED = "compression.method=int8"  # lossy: held to the same case under 1f1b, not to the reference


# name → (world, cases). Microbatches: 4 per step at dp=1, 2 at dp=2 (so no interleaving at pp4dp2).
# One case per code path: each schedule family at pp2 and pp4, with TP, SP, DP and ZeRO-1, both families,
# both recomputations; a family or schedule already shown at a layout is not repeated beside another one
# there, nor a schedule at a second layout that adds nothing to it (gpipe ↔ 1f1b at pp2dp2; llama at pp2 1f1b,
# pp4, tp2pp2 and pp2dp2, and in the zero-bubble launches; full recomputation at pp2 under 1f1b and zb1p:
# with TP and SP it is bit-identical to none in test_recompute, and TP + SP + PP recompute here selectively).
# DP under every schedule runs at pp2dp2 (4 ranks: what TP adds there is shown at tp2pp2); the three axes
# together (tp2pp2dp2, 8 ranks) with the plain DP sync and with ZeRO-1.
HPZ = ("parallel.ranks_per_node=2", "parallel.zero_hpz=true")  # ZeRO-3's later gathers of a step inside the node
LAUNCHES: dict[str, tuple[int, list[Case]]] = {
    "pp2": (2, cases("gpt", 1, 2, ("1f1b",), interleaved=True) + cases("llama", 1, 2, ("1f1b",))
            + [Case("gpt", 1, 2, "1f1b", extra=("train.recompute=full",))]),
    "pp4": (4, cases("llama", 1, 4, ("1f1b",), interleaved=True)
            + [Case("gpt", 1, 4, "1f1b", stage_layers=(0, 1, 3, 0))]),  # embedding-only and head-only stages
    "tp2pp2-sp": (4, cases("gpt", 2, 2, ("1f1b",), sp=True)
                  + [Case("llama", 2, 2, "interleaved", 2, sp=True, extra=("train.recompute=selective",))]),
    "pp2dp2": (4, cases("gpt", 1, 2, ALL)  # and the distributed optimizer (ZeRO-1), also interleaved:
               + [Case("gpt", 1, 2, "1f1b", zero=1), Case("llama", 1, 2, "interleaved", 2, zero=1)]),
    "tp2pp2dp2": (8, [Case("gpt", 2, 2, "1f1b"), Case("gpt", 2, 2, "interleaved", 2, zero=1),
                      Case("llama", 2, 2, "zb1p", sp=True, zero=2), Case("gpt", 2, 2, "interleaved", 2, zero=3),
                      Case("gpt", 1, 2, "1f1b", zero=3, extra=HPZ)]),  # pp2dp4 on 4 nodes of 2
    # the zero-bubble schedules (zb1p paired with the 1f1b cases above), with recomputation, SP (zb1p's split
    # backward through the TP layers; zbv's V placement is TP's business nowhere), ZeRO-1 and compression; the
    # tied embedding in both placements (zbv puts the embedding and the head on rank 0: gpt at pp2 and pp2dp2);
    # the schedules' own orders and, fitted to 1F1B's memory, these models (large logits) as the start-up line
    # shows: zb1p 0, unsplit at pp2 (recompute, ZeRO-1) and 0, 1, 2, 1 at pp4; zbv unsplit, 2 at pp2 and
    # unsplit, 0, 0, unsplit (llama) at pp4
    "pp2-zb": (2, zero_bubble("gpt", 1, 2) + [Case("llama", 1, 2, "zbv", 2, extra=())]
               + [Case("gpt", 1, 2, "zb1p", extra=("train.recompute=full",))]),
    "pp4-zb": (4, zero_bubble("llama", 1, 4, fitted=True)),
    "tp2pp2-sp-zb": (4, [Case("gpt", 2, 2, "zb1p", 1, True, extra=(OWN,))]),
    "pp2dp2-zb": (4, zero_bubble("gpt", 1, 2) + [Case("gpt", 1, 2, "zb1p", zero=1)]
                  + [Case("gpt", 1, 2, s, extra=(COMPRESSED,)) for s in ("1f1b", "zb1p")]),
}
SMALL = 4  # layers of a case's model where its partition allows: pp·v ≤ 4 parts


def smallest(case: Case) -> Case:
    """The case on the fewest layers that give each of its pp·v parts one (at least SMALL; under TP, whose
    collectives cost per layer, at least 2), or on those its stage_layers list: fewer layers per rank, the same
    code paths (held to the reference of that many)."""
    layers = sum(case.stage_layers) if case.stage_layers else max(SMALL if case.tp == 1 else 2, case.pp * case.v)
    return dataclasses.replace(case, layers=layers)


LAUNCHES = {name: (world, [smallest(c) for c in launch_cases]) for name, (world, launch_cases) in LAUNCHES.items()}
DP_LAUNCHES = ["pp2dp2", "tp2pp2dp2", "pp2dp2-zb"]
ERRORS: dict[str, float] = {}  # max |ours − reference| seen, by quantity (printed with -s)


def on_world(world: int) -> list[Case]:
    """Every case of every launch on `world` ranks."""
    return [case for w, launch_cases in LAUNCHES.values() if w == world for case in launch_cases]


@functools.cache
def world_launch(world: int) -> dict[str, list[dict[str, Any]]]:
    """Every case on `world` ranks, trained in one launch (run once per session): case → results by rank.
    The configs and the single-process references are made here first, so the forked ranks inherit them
    (and every import the training path makes on first use)."""
    torch.set_num_threads(1)
    every = on_world(world)
    assert len({str(c) for c in every}) == len(every), "a case is listed twice on this world"
    for case in every:
        make_cfg(case, world)
        reference(case.family, case.layers)
    results = run_ranks(train_cases, world, every, timeout=TIMEOUT)
    return {str(c): [r[i] for r in results] for i, c in enumerate(every)}


def launched(name: str) -> list[tuple[Case, list[dict[str, Any]]]]:
    """Every case of launch `name` with its results by rank (from the one launch of its world)."""
    world, launch_cases = LAUNCHES[name]
    return [(c, world_launch(world)[str(c)]) for c in launch_cases]


def schedule_pairs(name: str) -> list[tuple[str, Case, str, Case]]:
    """(launch, gpipe or zb1p case of launch `name`, launch, 1f1b case) of the same world that differ only in
    the schedule (a zero-bubble launch pairs with the 1f1b cases of the plain launch beside it)."""
    world, mine = LAUNCHES[name]
    others = [(n, o) for n, (w, launch_cases) in LAUNCHES.items() if w == world for o in launch_cases]
    return [(name, g, n, o) for g in mine for n, o in others
            if g.schedule in BIT_IDENTICAL_TO_1F1B and o.schedule == "1f1b"
            and (g.family, g.tp, g.pp, g.sp, g.zero) == (o.family, o.tp, o.pp, o.sp, o.zero)
            and tuple(e for e in g.extra if e != OWN) == o.extra]


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_pipeline_matches_single_process(name: str) -> None:
    for case, results in launched(name):
        assert {r["case"] for r in results} == {str(case)}
        if COMPRESSED not in case.extra:
            assert_matches_reference(results, reference(case.family, case.layers), ERRORS)
    print(f"\nmax abs difference from the single-process run so far: {ERRORS}")


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_eval_through_the_pipeline_matches_single_process(name: str) -> None:
    for case, results in launched(name):
        if COMPRESSED in case.extra:
            continue
        ref = reference(case.family, case.layers)["eval"]
        for r in results:  # computed on the last stage, broadcast over PP: every rank reports it
            torch.testing.assert_close(torch.tensor(r["eval"]), torch.tensor(ref), **LOSS_TOL,
                                       msg=lambda m, c=r["coord"], k=case: f"{k} eval at {c}: {m}")
            track(ERRORS, "eval", [r["eval"]], [ref])


@pytest.mark.parametrize("name", [n for n in LAUNCHES if schedule_pairs(n)])
def test_switching_gpipe_zb1p_and_1f1b_is_bit_identical(name: str) -> None:
    """zb1p splits each backward into its input and weight passes, yet every gradient is the same sum of the
    same products in the same order: bit-identical, also under compression (the DP buckets carry the same
    gradients, launched from the weight passes)."""
    for launch, gpipe, other, one_f in schedule_pairs(name):
        results = {str(c): rs for n in (launch, other) for c, rs in launched(n)}
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
            assert r["buckets"] >= 2, (str(case), r["coord"], r["buckets"])  # small bucket_mb: several buckets
            for step, log in enumerate(r["launch_logs"]):
                # every parameter of a stage gets a gradient, so every bucket must launch from the
                # gradient-ready hook while autograd runs (not from finish()), in index order; under ZeRO-2, 3 once
                # per microbatch, as its rounds complete
                if case.zero >= 2:
                    want = {b: r["microbatches"] for b in range(r["buckets"])}
                    assert Counter(i for i, _ in log) == want, (str(case), r["coord"], step, log)
                else:
                    assert [i for i, _ in log] == list(range(r["buckets"])), (str(case), r["coord"], step, log)
                assert all(inside for _, inside in log), (str(case), r["coord"], step, log)
    assert schedules >= ({"zb1p", "zbv"} if name.endswith("-zb") else {"1f1b"})


def test_dp_launches_cover_every_schedule_family() -> None:
    """The DP launches together run every schedule at dp > 1 (each checked above)."""
    schedules = {c.schedule for n in DP_LAUNCHES for c in LAUNCHES[n][1]}
    assert schedules == {"gpipe", "1f1b", "interleaved", "zb1p", "zbv"}


def tied_share(r: dict[str, Any], case: Case, world: int) -> int:
    """The elements of the tied embedding whose gradient this rank sums over the embedding group: its TP shard, or
    under ZeRO-2 and 3 the part of it in this DP rank's gradient shard (the tied copy has a bucket of its own)."""
    if case.zero < 2:
        return r["tied_numel"]
    dp = world // (case.tp * case.pp)
    k = padded_numel(r["tied_numel"], dp) // dp
    return min(k, max(0, r["tied_numel"] - r["coord"][1] * k))


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_pp_bytes_equal_the_analytic_figure(name: str) -> None:
    world = LAUNCHES[name][0]
    for case, results in launched(name):
        hidden = make_cfg(case, world).model.hidden
        for r in results:
            pp_rank = r["coord"][0]
            placement = SCHEDULES[case.schedule].placement
            want = pp_bytes_per_step(MICRO, SEQ, hidden, case.tp, case.sp, r["microbatches"], case.pp, case.v, pp_rank,
                                     placement=placement)
            # the tied embedding (GPT): one all-reduce of this rank's shard per step between the stages holding
            # the first and the last part; none where one stage holds both (the V placement: a local sum)
            ends = {place_of(placement, case.pp, part)[0] for part in (0, case.pp * case.v - 1)}
            tied = case.family == "gpt" and pp_rank in ends
            assert (r["tied_numel"] > 0) == tied, (str(case), r["coord"])
            embedding = {"all_reduce": 4 * tied_share(r, case, world)} if tied and len(ends) == 2 else {}
            for step, counted in enumerate(r["bytes"]):
                got = {op: b for (g, op), b in counted.items() if g == "pp"}
                assert got == want, (str(case), r["coord"], step, got, want)
                got = {op: b for (g, op), b in counted.items() if g == "embedding"}
                assert got == embedding, (str(case), r["coord"], step, got, embedding)
