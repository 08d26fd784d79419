"""TP communication overlap (`parallel.tp_overlap`) against the blocking TP run and the single process.

One world-4 launch trains, with each overlap mode, the same 2-layer model and layout (tp4 with SP, tp2·pp2 with SP
under zb1p's split backward, and under 1F1B with full recomputation and bf16 parameters, tp2·dp2 without SP) for two
steps through the trainer (`build_chunks`: the mode set from the config), then runs the two ring primitives on their
own (CP with chunked TP: tests/dist/test_cp.py's cp2tp2 case):

- bulk equals none bit for bit (losses, gradient norms, weights): only the order of independent work changes —
  the same collectives, launched earlier and waited for later;
- chunked equals none within fp32 rounding (the GEMMs split into pieces of the sequence, the ring's sums added
  in another order; rtol = atol = 1e-5 on losses, weights as the pipeline tests), and so the single process;
  under bf16 parameters within bf16 rounding (rtol 2e-2);
- every step's bytes per (group, op) are the blocking run's, exactly: each ring is counted as the collective it
  replaces;
- the ring primitives: `gather_each` hands every piece to its user (the all-gather's result, bit for bit),
  `reduce_scatter_each` sums like the reduce-scatter (fp64: to rounding), both with one and two pieces per rank,
  and the bytes their hops put on the wire are the collective's bus bytes, (n − 1)/n of its counted payload.

The configs are composed in the test process before the ranks fork (`pp_helpers.composed`'s memo), whose heap is
frozen while they run (`run_frozen`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from unittest import mock

import pytest
import torch
from pp_helpers import (
    LOSS_TOL,
    NORM_TOL,
    TIMEOUT,
    WEIGHT_TOL,
    Case,
    assert_matches_reference,
    layout_context,
    make_cfg,
    reference,
    train_case,
)
from tp_helpers import run_frozen

from hybrid.parallel import collectives as C
from hybrid.parallel.hops import Ring
from hybrid.parallel.tp.comm import gather_each, reduce_scatter_each

WORLD = 4
LAYERS = 2
MODES = ("none", "bulk", "chunked")


def case(family: str, tp: int, pp: int = 1, sp: bool = True, schedule: str = "1f1b", *extra: str) -> Case:
    return Case(family, tp, pp, schedule, sp=sp, extra=extra, layers=LAYERS)


LAYOUTS = {  # name → the case trained under each mode (its `extra` gets `parallel.tp_overlap=…`)
    "gpt-tp4-sp": case("gpt", 4),
    "llama-tp4-sp": case("llama", 4, 1, True, "1f1b", "model.n_heads=8", "model.n_kv_heads=4"),
    "llama-tp2pp2-sp-zb1p-8chunks": case("llama", 2, 2, True, "zb1p", "parallel.tp_overlap_chunks=8"),
}
OWN_MODEL = {"llama-tp4-sp"}  # 8 heads, 4 KV heads (one a rank): held to the blocking run only
NO_SP = {"gpt-tp2dp2": case("gpt", 2, sp=False)}  # bulk only: chunked needs SP
BF16 = {"gpt-tp2pp2-sp-recompute-bf16-params": case("gpt", 2, 2, True, "1f1b", "train.recompute=full",
                                                   "train.precision=bf16_params")}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}  # bf16 parameters: a GEMM split into pieces rounds each piece's bf16 output


def under(c: Case, mode: str) -> Case:
    return dataclasses.replace(c, extra=(*c.extra, f"parallel.tp_overlap={mode}"))


TWO_MODES = {"llama-tp4-sp": ("none", "chunked"), "gpt-tp2pp2-sp-recompute-bf16-params": ("none", "chunked"),
             "gpt-tp2dp2": ("none", "bulk")}  # bulk's bit-for-bit equality is the other layouts' to show


def modes_of(name: str) -> tuple[str, ...]:
    return TWO_MODES.get(name, MODES)


CASES = [under(c, m) for name, c in {**LAYOUTS, **BF16, **NO_SP}.items() for m in modes_of(name)]


def ring_bytes_sent() -> tuple[Any, dict[str, int]]:
    """A patch of `Ring.start` that adds up the bytes each TP hop sends (the tally, by the ring's op)."""
    sent: dict[str, int] = {}
    start = Ring.start

    def counting(self: Ring, tensors: list[torch.Tensor], counted: bool = True) -> Any:
        if self.name == "tp":
            sent[self.op] = sent.get(self.op, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return start(self, tensors, counted)

    return mock.patch.object(Ring, "start", counting), sent


def primitives(group: Any, lanes: int) -> dict[str, Any]:
    """`gather_each` and `reduce_scatter_each` at `lanes` pieces per rank, against the blocking collectives."""
    n, r = C.size(group), C.rank(group)
    x = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
    patch, sent = ring_bytes_sent()
    C.COUNTER.reset()
    gathered = torch.empty(2, 4 * n, 3, dtype=torch.float64)
    with patch:
        gather_each(x, group, lambda piece, rows: gathered[:, rows].copy_(piece), "all_gather", lanes)
        summed = reduce_scatter_each(lambda rows: gathered[:, rows] * (r + 1), 4 * n, group, lanes)
    counted = {op: b for (g, op), b in C.COUNTER.bytes.items() if g == "tp"}
    C.COUNTER.reset()
    want_gather = C.all_gather_seq(x, group)
    want_sum = C.reduce_scatter_seq(want_gather * (r + 1), group)
    blocking = {op: b for (g, op), b in C.COUNTER.bytes.items() if g == "tp"}
    return {"gather": torch.equal(gathered, want_gather), "sum": (summed, want_sum), "sent": sent,
            "counted": counted, "blocking": blocking, "n": n}


def launch_rank(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """Train each case (the groups built once per layout), tallying what its TP rings sent; then the primitives."""
    contexts: dict[tuple[int, int], Any] = {}
    out: dict[str, Any] = {"runs": {}}
    for c in cases:
        ctx = contexts.setdefault((c.tp, c.pp), layout_context(world, c))
        patch, sent = ring_bytes_sent()
        with patch:
            out["runs"][str(c)] = train_case(ctx, c, world) | {"ring_sent": sent}
    ctx = contexts.setdefault((world, 1), layout_context(world, Case(tp=world)))
    return out | {"primitives": {k: primitives(ctx.tp_group, k) for k in (1, 2)}}


@functools.cache
def launched() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    for c in CASES:  # composed here once, inherited by the forked ranks
        make_cfg(c, WORLD)
    return run_frozen(launch_rank, WORLD, CASES, timeout=TIMEOUT)


def runs(c: Case, mode: str) -> list[dict[str, Any]]:
    return [r["runs"][str(under(c, mode))] for r in launched()]


EXACT = {"rtol": 0.0, "atol": 0.0}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]], tols: tuple[dict, dict, dict]) -> None:
    """Every rank's losses, norms and (TP rank 0's) gathered weights of two runs within (loss, norm, weight) tols."""
    for x, y in zip(a, b):
        for key, tol in zip(("losses", "norms"), tols):
            torch.testing.assert_close(torch.tensor(x[key]), torch.tensor(y[key]), **tol, msg=f"{x['case']} {key}")
        if x["state"] is not None:
            for name, w in y["state"].items():
                torch.testing.assert_close(x["state"][name].float(), w.float(), **tols[2], msg=f"{x['case']} {name}")


ALL = {**LAYOUTS, **BF16, **NO_SP}


@pytest.mark.parametrize("name", [n for n in ALL if "bulk" in modes_of(n)])
def test_bulk_overlap_is_bit_identical_to_blocking(name: str) -> None:
    _same(runs(ALL[name], "bulk"), runs(ALL[name], "none"), (EXACT, EXACT, EXACT))


@pytest.mark.parametrize("name", [*LAYOUTS, *BF16])
def test_chunked_overlap_matches_blocking_and_the_single_process(name: str) -> None:
    c = ALL[name]
    _same(runs(c, "chunked"), runs(c, "none"), (BF16_TOL,) * 3 if name in BF16 else (LOSS_TOL, NORM_TOL, WEIGHT_TOL))
    if name in LAYOUTS and name not in OWN_MODEL:
        assert_matches_reference(runs(c, "chunked"), reference(c.family, LAYERS))


@pytest.mark.parametrize("name", ALL)
def test_overlap_moves_the_blocking_bytes(name: str) -> None:
    c = ALL[name]
    blocking = runs(c, "none")
    for mode in modes_of(name):
        for ours, ref in zip(runs(c, mode), blocking):
            assert ours["bytes"] == ref["bytes"], (name, mode, ours["coord"])
            assert any(g == "tp" for step in ours["bytes"] for g, _ in step), name  # TP traffic was there


@pytest.mark.parametrize("name", ALL)
def test_only_chunked_runs_the_tp_rings(name: str) -> None:
    c = ALL[name]
    for mode in modes_of(name):
        sent = [r["ring_sent"] for r in runs(c, mode)]
        if mode == "chunked":  # forward and backward: all-gathers and reduce-scatters around the ring
            assert all({"all_gather", "reduce_scatter"} <= set(s) for s in sent), (name, sent)
        else:
            assert not any(sent), (name, mode, sent)


@pytest.mark.parametrize("lanes", [1, 2])
def test_ring_primitives_equal_the_collectives_and_send_their_bus_bytes(lanes: int) -> None:
    for rank in launched():
        p = rank["primitives"][lanes]
        assert p["gather"]
        torch.testing.assert_close(*p["sum"], rtol=1e-12, atol=1e-12)
        assert p["counted"] == p["blocking"]  # counted as the collectives they replace
        n = p["n"]
        for op in ("all_gather", "reduce_scatter"):  # each hop sends 1/n of the payload, n − 1 hops
            assert p["sent"][op] * n == p["counted"][op] * (n - 1), (op, p)
