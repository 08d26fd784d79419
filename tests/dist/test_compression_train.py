"""DP gradient compression inside the Trainer, on gloo ranks, against references.

One world-4 launch trains every method (`compression=<method>`) at pp2dp2, one after another with a
fresh model and Trainer each (the process groups are built once per layout), plus hierarchical at dp4
where both the intra-node and the inter-node part of the DP group have two ranks. For every step of
every method it records how often the hook ran per bucket, the bytes counted per DP group, and what the
library's own payload formulas say those bytes must be (`codecs.payload_bytes`, `powersgd.payload_bytes`,
`hierarchical.row_ranges`): they must agree exactly. The loss must fall under every method, and
`StepReport.mean_bytes()` must report the ratio those counted bytes imply. The same launch then trains
lossy methods at tp2dp2 and pp2dp2 to check that model-parallel replicas stay equal.

A world-2 launch (dp=2) checks the warm-up against an uncompressed run (bit for bit, then not) and
PyTorch's own DDP hooks against ours: `torch_fp16` vs `fp16`, `torch_powersgd` vs `powersgd`.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Optional

import pytest
import torch
from harness import run_ranks
from pp_helpers import VOCAB, Case, make_cfg
from test_dp import synthetic_corpus

from hybrid.compression import codecs, hierarchical, powersgd, scaling
from hybrid.compression.defaults import warmup_of
from hybrid.compression.hooks import make_hook
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.data import DP_GROUPS
from hybrid.trainer import Trainer, build_chunks

STEPS = 3  # torch_powersgd: 2 exact warm-up steps, then 1 compressed
TIMEOUT = 240
BUCKET_MB = 0.06  # several buckets per stage of the 4-layer model (and per rank at pp=1)
# 8 training sequences = one global batch: every step sees the same batch (in another order), so the
# loss falls steadily within STEPS steps instead of wandering with the batch.
SAMPLES = 16
COMMON = [f"train.steps={STEPS}", "train.lr=1e-2", "model.n_layers=4"]

# label → (case, ranks per node, overrides); all on 4 ranks, nodes of 2
RUNS: dict[str, tuple[Case, int, list[str]]] = {
    m: (Case(pp=2), 2, [f"compression={m}"])
    for m in ("none", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd", "torch_fp16", "torch_powersgd")
}
RUNS["hierarchical"] = (Case(pp=2), 2, ["compression=hierarchical", "compression.inner=powersgd"])
# pp2dp2 on nodes of 2 keeps each DP pair inside a node (the inter-node part is one rank): there
# hierarchical is exact. At dp4 each DP group is 2 ranks on each of 2 nodes, so both hops are real.
RUNS["hierarchical-dp4"] = (Case(), 2, ["compression=hierarchical", "compression.inner=powersgd"])
RUNS["hierarchical-sign"] = (Case(), 2, ["compression=hierarchical", "compression.inner=sign"])  # scaled pieces
RUNS["powersgd-llama"] = (Case("llama", pp=2), 2, ["compression=powersgd"])  # an untied token embedding: rows
WORLD = 4

ALL_REDUCE, TWO_PHASE = "all_reduce", "two_phase"


def _wire(kind: str, payload: int, n: int) -> float:
    """What one rank sends for a counted payload: ring all-reduce 2(n−1)/n, all-to-all/gather/scatter (n−1)/n."""
    return payload * (2 if kind == ALL_REDUCE else 1) * (n - 1) / n


def _flat(method: str, c: Any, numel: int, shapes: list[torch.Size], n: int,
          tables: Optional[dict[int, Optional[int]]] = None) -> tuple[int, str]:
    """Counted payload of one bucket (numel elements, gradient `shapes`) under a flat method over n ranks;
    `tables`: PowerSGD's lookup tables of the bucket and the rows each sent (`rows_sent`)."""
    if n == 1:
        return 0, ALL_REDUCE  # size-1 group: no collective runs
    if method == "none":
        return 4 * numel, ALL_REDUCE
    if method in ("fp16", "bf16", "torch_fp16", "torch_bf16"):
        return 2 * numel, ALL_REDUCE
    if method in ("powersgd", "torch_powersgd"):  # ours probes its error under an adaptive rank
        ours = method == "powersgd"
        return powersgd.payload_bytes(shapes, c.rank, c.min_compression_rate, probed=ours and c.target_error > 0,
                                      tables=tables, factor_bytes=powersgd.factor_bytes(c) if ours else 4), ALL_REDUCE
    return codecs.payload_bytes(codecs.CODECS[method].build(c), numel, n), TWO_PHASE


def _stats(method: str, c: Any, shapes: list[torch.Size], n: int) -> tuple[int, str]:
    """The factored scale's statistics all-reduce of one bucket, where the method runs on scaled values."""
    return (scaling.stats_bytes(shapes) if n > 1 and method in codecs.CODECS and scaling.scaled(c, method) else 0,
            ALL_REDUCE)


def expected_step(c: Any, step: int, buckets: list[Any], ctx: ParallelContext,
                  rows_sent: Optional[dict[int, dict[int, Optional[int]]]] = None) -> tuple[dict[str, int], float]:
    """(counted payload per DP group, wire bytes this rank sends) of one step, from the library's formulas
    (`rows_sent`: PowerSGD's lookup tables per bucket, what each sent this step)."""
    payload, wire = dict.fromkeys(DP_GROUPS, 0), 0.0

    def add(group: str, amount: tuple[int, str], n: int) -> None:
        nonlocal wire
        payload[group] += amount[0]
        wire += _wire(amount[1], amount[0], n)

    for b in buckets:
        numel, shapes = b.buffer().numel(), [g.shape for g in b.gradients()]
        # warm-up: ours via Compression (exact fp32), PyTorch's PowerSGD via start_powerSGD_iter (the same)
        method = "none" if step < warmup_of(c, None) else c.method  # null: no run length given, the least
        if method != "hierarchical":
            tables = (rows_sent or {}).get(b.index()) if method != "none" else None
            add("dp", _flat(method, c, numel, shapes, ctx.dp_size, tables), ctx.dp_size)
            add("dp", _stats(method, c, shapes, ctx.dp_size), ctx.dp_size)
            continue
        r, j, n_inter = C.size(ctx.dp_intra_group), C.rank(ctx.dp_intra_group), C.size(ctx.dp_inter_group)
        ranges = hierarchical.row_ranges(shapes, r)
        longest = max(e - s for s, e in ranges)
        add("dp_intra", (2 * 4 * r * longest if r > 1 else 0, TWO_PHASE), r)  # reduce-scatter in + all-gather out
        piece = hierarchical.piece_shapes(shapes, ranges[j])
        add("dp_inter", _flat(c.inner, c, ranges[j][1] - ranges[j][0], piece, n_inter), n_inter)
        add("dp_inter", _stats(c.inner, c, piece, n_inter), n_inter)
    return payload, wire


def method_cfg(case: Case, world: int, ranks_per_node: int, overrides: list[str]) -> Any:
    return make_cfg(case, world, bucket_mb=BUCKET_MB,
                    extra=[*COMMON, f"parallel.ranks_per_node={ranks_per_node}", *overrides])


def composed_before_the_fork(world: int, runs: dict[str, tuple[Case, int, list[str]]], steps: int) -> None:
    """Compose every run's config in this process, so the forked ranks inherit them (`compose_config`'s
    memo) instead of each rank composing each one."""
    for case, rpn, overrides in runs.values():
        layout = Layout.create(world, tp=case.tp, pp=case.pp, ranks_per_node=rpn)
        method_cfg(case, world, layout.ranks_per_node, [*overrides, f"train.steps={steps}"])


def train_method(ctx: ParallelContext, case: Case, world: int, overrides: list[str], steps: int = STEPS,
                 measure_last: bool = True) -> dict[str, Any]:
    """Train one method from scratch on this rank; record per step what the hook and the counter saw."""
    cfg = method_cfg(case, world, ctx.layout.ranks_per_node, overrides)
    model = build_chunks(cfg, VOCAB, ctx)
    hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
    calls: list[int] = []

    def counted(st: Any, bucket: Any) -> torch.futures.Future:
        calls.append(bucket.index())
        return hook(st, bucket)

    trainer = Trainer(cfg, ctx, model, synthetic_corpus(vocab=VOCAB, n=SAMPLES), torch.device("cpu"), counted, state)
    buckets = trainer.grad_sync.buckets
    out: dict[str, Any] = {"coord": (ctx.coord.pp, ctx.coord.dp, ctx.coord.tp), "buckets": len(buckets), "losses": [],
                           "norms": [], "calls": [], "bytes": [], "expected": [], "wire": [], "expected_wire": [],
                           "rows_sent": []}
    for step in range(steps):
        C.COUNTER.reset()
        calls.clear()
        trainer.grad_sync.meter(measure_last and step == steps - 1)  # the meter's all-reduce: not in bytes_dp
        r = trainer.train_step()
        out["losses"].append(r.loss)
        out["norms"].append(r.grad_norm)
        out["calls"].append(list(calls))
        out["bytes"].append({g: C.COUNTER.group_bytes(g) for g in DP_GROUPS})
        out["wire"].append(sum(C.COUNTER.wire_bytes(g) for g in DP_GROUPS))
        rows_sent = copy.deepcopy(getattr(state.state, "rows_sent", {}))
        payload, wire = expected_step(cfg.compression, step, buckets, ctx, rows_sent)
        out["rows_sent"].append(rows_sent)
        out["expected"].append(payload)
        out["expected_wire"].append(wire)
    n = ctx.dp_size
    out["plain_wire"] = 4 * sum(b.buffer().numel() for b in buckets) * 2 * (n - 1) / n
    out["mean_bytes"] = trainer.report.mean_bytes()  # collective over the world: the last step's figures
    out["iteration"] = state.iteration
    out["torch_iter"] = getattr(state.state, "iter", None)  # PyTorch's PowerSGDState counts steps too
    return out


def train_runs(rank: int, world: int, runs: dict[str, tuple[Case, int, list[str]]],
               steps: int = STEPS) -> dict[str, dict[str, Any]]:
    """Rank function: every run in turn, `steps` steps each; process groups built once per (tp, pp, ranks per
    node)."""
    torch.set_num_threads(1)
    contexts: dict[tuple[int, int, int], ParallelContext] = {}
    out = {}
    for label, (case, rpn, overrides) in runs.items():
        key = (case.tp, case.pp, rpn)
        if key not in contexts:
            ctx = ParallelContext.build(Layout.create(world, tp=case.tp, pp=case.pp, ranks_per_node=rpn))
            contexts[key] = ctx
        out[label] = train_method(contexts[key], case, world, [*overrides, f"train.steps={steps}"], steps)
    return out


def world4_runs(rank: int, world: int) -> dict[str, Any]:
    """Rank function of the world-4 launch: every method (`train_runs`), then the replicas' runs."""
    return {"runs": train_runs(rank, world, RUNS),
            "replicas": {str(case): replicas_worker(rank, world, case, methods) for case, methods in REPLICAS}}


@functools.cache
def world4() -> dict[str, Any]:
    """The one world-4 launch (run once per session): "runs": label → results by rank; "replicas": case →
    results by rank."""
    torch.set_num_threads(1)
    composed_before_the_fork(WORLD, RUNS, STEPS)
    for case, methods in REPLICAS:
        for method in methods:
            replicas_cfg(case, WORLD, method)
    results = run_ranks(world4_runs, WORLD, timeout=TIMEOUT)
    return {"runs": {label: [r["runs"][label] for r in results] for label in RUNS},
            "replicas": {str(case): [r["replicas"][str(case)] for r in results] for case, _ in REPLICAS}}


def method_runs() -> dict[str, list[dict[str, Any]]]:
    """label → results by rank of every method's run (`RUNS`)."""
    return world4()["runs"]


@pytest.mark.parametrize("label", list(RUNS))
def test_hook_runs_once_per_bucket_per_step(label: str) -> None:
    for r in method_runs()[label]:
        assert r["buckets"] >= 3, (label, r["coord"], r["buckets"])  # several buckets per stage
        for step, calls in enumerate(r["calls"]):
            assert calls == list(range(r["buckets"])), (label, r["coord"], step, calls)
        assert r["iteration"] == STEPS, (label, r["coord"], r["iteration"])
        if label == "torch_powersgd":
            assert r["torch_iter"] == STEPS  # PyTorch's own state saw each step's last bucket once


@pytest.mark.parametrize("label", list(RUNS))
def test_counted_dp_bytes_equal_the_method_formula(label: str) -> None:
    results = method_runs()[label]
    for r in results:
        for step in range(STEPS):
            assert r["bytes"][step] == r["expected"][step], (label, r["coord"], step)
            assert r["wire"][step] == pytest.approx(r["expected_wire"][step], rel=1e-12)
    first, last = results[0]["bytes"][0], results[0]["bytes"][-1]
    if label.startswith("hierarchical"):
        assert first["dp"] == 0 and first["dp_intra"] > 0  # exact inside the node, by reduce-scatter/all-gather
        if label != "hierarchical":  # at dp4: the slow hop carries rank-4 factors (signs) of 1/2
            assert 0 < first["dp_inter"] < first["dp_intra"] / 4
        else:
            assert first["dp_inter"] == 0  # the DP pair lives inside one node: nothing crosses nodes
    elif label == "torch_powersgd":
        assert first["dp"] > 4 * last["dp"]  # 2 exact warm-up steps (start_powerSGD_iter), then compressed
    elif label != "none":
        sent, exact = results[0]["wire"][-1], method_runs()["none"][0]["wire"][-1]
        assert 0 < sent <= exact / 2, (label, sent, exact)  # every method sends at most half of fp32's bytes


def test_powersgd_treats_the_untied_token_embedding_as_a_table() -> None:
    """Llama's token embedding (untied, on the first stage) is PowerSGD's one lookup table: its mask is exchanged
    (the bytes above count it); this corpus touches every row, so it goes as factors (rows: test_lookup_rows.py)."""
    for r in method_runs()["powersgd-llama"]:
        tables = [rows for bucket in r["rows_sent"][-1].values() for rows in bucket.values()]
        assert tables == ([None] if r["coord"][0] == 0 else []), r["coord"]


@pytest.mark.parametrize("label", list(RUNS))
def test_loss_falls_under_every_method(label: str) -> None:
    results = method_runs()[label]
    losses = results[0]["losses"]
    assert losses[-1] < losses[0] - 0.1, (label, losses)
    for r in results:  # the loss is the DP mean of the last stage's: the same number on every rank
        assert r["losses"] == losses, (label, r["coord"])


@pytest.mark.parametrize("label", list(RUNS))
def test_mean_bytes_reports_the_counted_compression(label: str) -> None:
    results = method_runs()[label]
    world = len(results)
    plain = sum(r["plain_wire"] for r in results)
    wire = sum(r["expected_wire"][-1] for r in results)
    dp = sum(sum(r["expected"][-1].values()) for r in results) / world
    for r in results:
        m = r["mean_bytes"]
        assert m["compression_ratio"] == pytest.approx(plain / wire, rel=1e-9), label
        assert m["bytes_dp"] == pytest.approx(dp, rel=1e-12), label
        if label.startswith("hierarchical"):
            inter = sum(q["expected"][-1]["dp_inter"] for q in results) / world
            assert m["bytes_dp_inter"] == pytest.approx(inter, rel=1e-12)
        else:
            assert "bytes_dp_inter" not in m
        # the last step was metered: ‖ĝ − g‖/‖g‖ against an exact all-reduce (never for the exact hook)
        if label == "none":
            assert "compression_error" not in m and "bytes_meter" not in m
            continue
        err = m["compression_error"]
        assert math.isfinite(err) and err >= 0, (label, err)
        if label == "hierarchical":  # exact (hierarchical: no inter-node hop at this layout)
            assert err < 1e-6, (label, err)
        elif label in ("fp16", "bf16", "torch_fp16"):
            assert 1e-7 < err < 1e-2, (label, err)  # 16-bit rounding: small but not zero
        else:
            assert err > 1e-3, (label, err)  # lossy compression shows
    if label == "none":
        assert results[0]["mean_bytes"]["compression_ratio"] == 1.0
    if label in ("fp16", "bf16", "torch_fp16"):
        assert results[0]["mean_bytes"]["compression_ratio"] == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("label", ["int8", "sign", "topk", "powersgd"])
def test_the_error_budget_names_every_bucket_of_every_stage(label: str) -> None:
    """`compression/pp<s>.b<i>/…`: each stage's buckets, their metered error around the step's overall one (a
    weighted RMS of theirs), PowerSGD's rank and top-k's density where the method sets one."""
    results = method_runs()[label]
    m = results[0]["mean_bytes"]
    stages = {r["coord"][0]: r["buckets"] for r in results}
    names = [f"pp{s}.b{i}" for s, n in stages.items() for i in range(n)]
    errors = [m[f"compression/{name}/error"] for name in names]
    assert min(errors) <= m["compression_error"] * (1 + 1e-9) and max(errors) >= m["compression_error"] * (1 - 1e-9)
    assert all(r["mean_bytes"] == m for r in results)  # one all-reduce: every rank reads the same record
    if label == "topk":
        assert all(m[f"compression/{name}/density"] == 0.01 for name in names)
    if label == "powersgd":
        ranks = [m[f"compression/{name}/rank"] for name in names if f"compression/{name}/rank" in m]
        assert ranks and all(1 <= r <= 4 for r in ranks)
    assert not any(k.endswith("/density") for k in m) or label == "topk"


# ---- dp=2: warm-up against an uncompressed run; PyTorch's hooks against ours ----------------------

PAIR_RUNS: dict[str, tuple[Case, int, list[str]]] = {
    "none": (Case(), 2, ["compression=none"]),
    "powersgd-warm2": (Case(), 2, ["compression=powersgd", "compression.warmup_steps=2",
                                   "compression.target_error=0", "compression.factor_dtype=fp32"]),  # as PyTorch's
    "sign-warm3": (Case(), 2, ["compression=sign", "compression.warmup_steps=3"]),
    "fp16": (Case(), 2, ["compression=fp16"]),
    "torch_fp16": (Case(), 2, ["compression=torch_fp16"]),
    "torch_powersgd": (Case(), 2, ["compression=torch_powersgd", "compression.warmup_steps=2"]),
}


PAIR_STEPS = 5  # sign-warm3: 3 exact steps, then 2 compressed steps to tell apart from the exact run


@functools.cache
def world2() -> dict[str, list[dict[str, Any]]]:
    torch.set_num_threads(1)
    composed_before_the_fork(2, PAIR_RUNS, PAIR_STEPS)
    results = run_ranks(train_runs, 2, PAIR_RUNS, PAIR_STEPS, timeout=TIMEOUT)
    return {label: [r[label] for r in results] for label in PAIR_RUNS}


@pytest.mark.parametrize("label,warmup", [("powersgd-warm2", 2), ("sign-warm3", 3)])
def test_warmup_steps_are_exact_then_compressed(label: str, warmup: int) -> None:
    runs = world2()
    for ref, r in zip(runs["none"], runs[label]):
        # step k's gradient norm is taken after step k's sync; step k's loss before it
        assert r["norms"][:warmup] == ref["norms"][:warmup], (label, r["norms"], ref["norms"])
        assert r["norms"][warmup] != ref["norms"][warmup]
        assert r["losses"][:warmup + 1] == ref["losses"][:warmup + 1], (label, r["losses"], ref["losses"])
        assert all(a != b for a, b in zip(r["losses"][warmup + 1:], ref["losses"][warmup + 1:])), label
        assert r["bytes"][:warmup] == ref["bytes"][:warmup]  # exact fp32 all-reduce while warming up
        assert all(b["dp"] < ref["bytes"][0]["dp"] / 4 for b in r["bytes"][warmup:])
        assert r["bytes"] == r["expected"]


def test_torch_fp16_hook_matches_ours() -> None:
    runs = world2()
    for ours, theirs, exact in zip(runs["fp16"], runs["torch_fp16"], runs["none"]):
        assert theirs["bytes"] == ours["bytes"] == theirs["expected"]
        # PyTorch casts, then divides in fp16; we divide in fp32, then cast: the same but for fp16
        # subnormals, whose differences Adam then carries along the run
        torch.testing.assert_close(torch.tensor(theirs["losses"]), torch.tensor(ours["losses"]), rtol=0, atol=1e-3)
        torch.testing.assert_close(torch.tensor(theirs["norms"]), torch.tensor(ours["norms"]), rtol=1e-3, atol=0)
        # the first step's synced gradient is the exact mean rounded to fp16 (a missing 1/n doubles it)
        assert theirs["norms"][0] == pytest.approx(exact["norms"][0], rel=1e-4)
        assert theirs["norms"][0] != exact["norms"][0]  # and it was rounded
        assert theirs["losses"][1:] != exact["losses"][1:]
        # both errors are fp16 rounding (a cast and the fp16 sum: about fp16's unit roundoff u, more where the
        # ranks' gradients cancel), far under bf16's 8u; measured on one step, where a few large elements can
        # dominate the norm, so only their size is compared (they differed by 16 % on another machine)
        e_theirs, e_ours = theirs["mean_bytes"]["compression_error"], ours["mean_bytes"]["compression_error"]
        u = torch.finfo(torch.float16).eps / 2
        assert 0 < e_ours < 4 * u and 0 < e_theirs < 4 * u, (e_theirs, e_ours, u)
        assert 0.5 < e_theirs / e_ours < 2, (e_theirs, e_ours)


def test_torch_powersgd_hook_matches_ours() -> None:
    runs = world2()
    for ours, theirs, exact in zip(runs["powersgd-warm2"], runs["torch_powersgd"], runs["none"]):
        assert theirs["bytes"] == ours["bytes"] == theirs["expected"]  # same rank, same warm-up, same factors sent
        assert theirs["bytes"][2]["dp"] < theirs["bytes"][0]["dp"] / 4
        assert theirs["losses"][:3] == ours["losses"][:3] == exact["losses"][:3]  # warm-up: exact for both
        assert theirs["norms"][:2] == ours["norms"][:2] == exact["norms"][:2]
        # from the first compressed step on they differ from the exact run, and (different random
        # first factors) from each other, but approximate the same mean at the same rank
        assert theirs["norms"][2] != exact["norms"][2] and ours["norms"][2] != exact["norms"][2]
        assert theirs["norms"][2] == pytest.approx(ours["norms"][2], rel=1e-2)
        lt, lo = torch.tensor(theirs["losses"]), torch.tensor(ours["losses"])
        assert (lt - lo).abs().max() < 0.1, (lt, lo)
        assert lt[-1] < lt[0] - 0.5 and lo[-1] < lo[0] - 0.5
        e_theirs, e_ours = theirs["mean_bytes"]["compression_error"], ours["mean_bytes"]["compression_error"]
        assert 0.75 < e_theirs / e_ours < 1.33, (e_theirs, e_ours)  # rank-4 errors of the same size


# ---- model-parallel replicas stay equal under lossy sync ----------------------------------------------

REPLICAS = [(Case(tp=2), ("sign", "onebit_adam")), (Case(pp=2), ("onebit_adam",))]  # tp2dp2, pp2dp2


def replicas_cfg(case: Case, world: int, method: str) -> Any:
    return make_cfg(case, world, extra=["train.steps=4", f"compression={method}", "compression.warmup_steps=2"])


def replicas_worker(rank: int, world: int, case: Case, methods: tuple[str, ...]) -> dict[str, Any]:
    """Train each method a few steps past its warm-up; return this rank's TP-replicated parameters and its
    copy of the tied embedding (first stage: tok_embed, last stage: head)."""
    from pp_helpers import layout_context

    from hybrid.parallel.params import param_info

    ctx = layout_context(world, case)
    out: dict[str, Any] = {"coord": (ctx.coord.pp, ctx.coord.dp, ctx.coord.tp)}
    for method in methods:
        cfg = replicas_cfg(case, world, method)
        torch.manual_seed(1234 + ctx.pp_rank)
        hook, state = make_hook(cfg.compression, ctx.dp_group)
        trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"),
                          hook, state)
        for _ in range(cfg.train.steps):
            trainer.train_step()
        named = dict(trainer.model.named_parameters())
        out[method] = {"replicated": {n: p.detach().clone() for n, p in named.items() if param_info(p).shard is None},
                       "tied": next((p.detach().clone() for n, p in named.items() if n.endswith(("tok_embed.weight",
                                     "head.weight")) and param_info(p).pp_tied | param_info(p).pp_duplicate), None)}
    return out


@pytest.mark.parametrize("case,methods", REPLICAS, ids=["tp2dp2", "pp2dp2"])
def test_lossy_sync_keeps_model_parallel_replicas_equal(case: Case, methods: tuple[str, ...]) -> None:
    """A norm's copies on the TP ranks, and the tied embedding's on the first and last stage, get the same
    update although the DP exchange rounds: each sits in a bucket of its own kind (`sync_class`)."""
    runs = {r["coord"]: r for r in world4()["replicas"][str(case)]}
    for method in methods:
        for (pp, dp, tp), r in runs.items():
            if case.tp > 1:
                other = runs[(pp, dp, 1 - tp)][method]["replicated"]
                assert all(torch.equal(v, other[k]) for k, v in r[method]["replicated"].items()), (method, pp, dp)
        if case.pp > 1:
            for dp in range(2):
                first, last = runs[(0, dp, 0)][method]["tied"], runs[(1, dp, 0)][method]["tied"]
                assert first is not None and torch.equal(first, last), (method, dp)
