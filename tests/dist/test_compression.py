"""DP gradient compression on gloo ranks, against references: the exact fp32 mean (`dist.all_reduce`),
PyTorch's DDP with its own comm hooks, the payload formulas, and an uninterrupted run.

Every rank's gradients come from a seed (`grads(rank, step)`), so the test process can rebuild all
ranks' inputs and derive each method's error bound from them; the exact mean is a real all-reduce.
Ranks are shared between checks: one launch per world size (2, 4 and 8 ranks, once per session: `launched`)
runs every worker of that size in turn, and many assertions read their results.
"""

from __future__ import annotations

import copy
import functools
import io
import math
from collections.abc import Callable

import pytest
import torch
import torch._dynamo  # noqa: F401  (DDP imports it on first use, ~2 s in every forked rank: import once here)
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hybrid.compression import codecs, powersgd, scaling
from hybrid.compression.hierarchical import piece_shapes, row_ranges
from hybrid.compression.hooks import make_hook
from hybrid.compression.zero import TwoHop
from hybrid.config import CompressionConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout
from hybrid.parallel.dp.buckets import GradBucket
from hybrid.parallel.dp.data import GradSync
from hybrid.parallel.params import ParamInfo

SHAPES = [[(64, 48), (48,)], [(100, 3), (20, 30), (7,)], [(16, 8, 4), (32,)]]
"""Three buckets: a matrix and its bias; a tall thin matrix PowerSGD sends exactly, a small matrix it
compresses and a bias; a 3-D tensor (compressed as its 16 × 32 view) and a bias."""
RANK, BLOCK, FRACTION, MIN_RATE = 4, 32, 0.1, 2.0
CASES: dict[str, dict] = {
    "none": {}, "fp16": {}, "bf16": {}, "int8": {"block_size": BLOCK}, "int4": {"block_size": BLOCK},
    "sign": {"block_size": BLOCK},
    "topk": {"fraction": FRACTION}, "powersgd": {"rank": RANK, "factor_dtype": "fp32"}, "torch_fp16": {},
    "torch_bf16": {},
    "torch_powersgd": {"rank": RANK, "warmup_steps": 2},
}
CAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "torch_fp16": torch.float16, "torch_bf16": torch.bfloat16}
EF_METHODS = ("sign", "topk", "int4", "powersgd")
EF_STEPS = 50
EF_SHAPES = [[s for b in SHAPES for s in b]]
TIMEOUT = 120


def workers(world: int) -> dict[str, Callable[[int, int], object]]:
    """The rank functions run on `world` ranks, by name (each defined with its checks below)."""
    if world == 2:
        return {"one_step": one_step_worker, "error_feedback": error_feedback_worker, "ddp": ddp_worker,
                "torch_hooks": torch_hooks_worker, "bias": bias_bucket_worker, "columns": columns_worker}
    if world == 4:
        return {"one_step": one_step_worker, "state": state_worker}
    return {"hierarchical": hierarchical_worker, "qgz": qgz_worker}


def run_workers(rank: int, world: int) -> dict[str, object]:
    """Rank function: every worker of this world size in turn → its result by name."""
    return {name: fn(rank, world) for name, fn in workers(world).items()}


@functools.cache
def launched(world: int) -> dict[str, list]:
    """worker name → its results by rank, from the one launch on `world` ranks."""
    torch.set_num_threads(1)
    results = run_ranks(run_workers, world, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in workers(world)}


def cfg(method: str, **kw: object) -> CompressionConfig:
    return CompressionConfig(method=method, **{**CASES.get(method, {}), **kw})


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def grads(rank: int, step: int, shapes: list = SHAPES, low_rank: int = 0, shared_basis: bool = False) -> list:
    """Rank `rank`'s flat bucket gradients at `step`, from a seed.

    `low_rank` > 0: every matrix PowerSGD compresses at RANK is a product of rank `low_rank`
    (`shared_basis`: its column space is shared by all ranks, so every sum of them has that rank too)."""
    gen = torch.Generator().manual_seed(10_007 * step + rank)
    out = []
    for b, bucket in enumerate(shapes):
        parts = []
        for t, s in enumerate(bucket):
            rows, cols = powersgd.matrix_shape(torch.Size(s))
            if low_rank and powersgd.compressed_rank(torch.Size(s), RANK, MIN_RATE):
                basis_gen = torch.Generator().manual_seed(1000 + 10 * b + t) if shared_basis else gen
                u = torch.randn(rows, low_rank, generator=basis_gen)
                parts.append((u @ torch.randn(low_rank, cols, generator=gen)).reshape(-1))
            else:
                parts.append(torch.randn(numel(s), generator=gen))
        out.append(torch.cat(parts))
    return out


def make_bucket(index: int, buf: torch.Tensor, shapes: list, last: bool) -> GradBucket:
    return GradBucket(index, buf.clone(), [nn.Parameter(torch.empty(s)) for s in shapes], last)


def value(fut: torch.futures.Future) -> torch.Tensor:
    v = fut.wait()
    return v[0] if isinstance(v, list) else v


def step(hook: object, state: object, bufs: list, shapes: list = SHAPES) -> list:
    """One step as GradSync runs it: launch every bucket's hook in index order, then wait for all."""
    buckets = [make_bucket(i, b, shapes[i], i == len(bufs) - 1) for i, b in enumerate(bufs)]
    futs = [hook(state, b) for b in buckets]
    return [value(f).clone() for f in futs]


def exact_mean(bufs: list, group: dist.ProcessGroup) -> list:
    """The reference: fp32 sum by `dist.all_reduce` (uncounted), divided by the group size."""
    out = []
    for b in bufs:
        t = b.clone()
        dist.all_reduce(t, group=group)
        out.append(t / dist.get_world_size(group))
    return out


def counted_step(hook: object, state: object, bufs: list, shapes: list, names: tuple) -> tuple[list, list]:
    """Run the buckets one at a time, resetting the counter around each call: (outputs, bytes per group)."""
    outs, counted = [], []
    for i, b in enumerate(bufs):
        C.COUNTER.reset()
        outs.append(value(hook(state, make_bucket(i, b, shapes[i], i == len(bufs) - 1))).clone())
        counted.append({n: C.COUNTER.group_bytes(n) for n in names})
    return outs, counted


# ---- error bounds, derived from every rank's inputs ---------------------------------------------

def cast_bound(inputs: list, dtype: torch.dtype) -> torch.Tensor:
    """|16-bit mean − exact mean| per element. Each rank's x/n (or x cast, then divided by a power of
    two) is rounded once and the n terms are summed with n − 1 roundings in 16 bits: at most
    n·u·Σ|x_i|/n to first order (u = eps/2); (n+1) covers the second order, plus subnormal spacing."""
    n, fi = len(inputs), torch.finfo(dtype)
    return (n + 1) * (fi.eps / 2) * sum(x.abs() for x in inputs) / n + (n + 1) * fi.smallest_normal * fi.eps


def absmax_bound(inputs: list, codec: codecs.Int8Codec) -> torch.Tensor:
    """|two-phase absmax mean − exact mean| per element: each rank's block quantised with scale absmax/L
    (L = 127 for int8, 7 for int4: error ≤ absmax/2L), the n decoded copies averaged, the average requantised
    (error ≤ its absmax/2L, and its absmax ≤ the exact mean's absmax + the first error)."""
    n, size, block, steps = len(inputs), inputs[0].numel(), codec.block, 2 * codec.LEVELS
    length = codecs.chunk_len(codec, size, n)
    x = torch.stack([F.pad(t, (0, n * length - size)) for t in inputs]).view(n, -1, block)
    first = (x.abs().amax(-1) / steps).mean(0)
    second = (x.mean(0).abs().amax(-1) + first) / steps
    slack = 1e-6 * x.abs().amax(-1).amax(0)  # fp32 rounding of x/scale·scale and of the averages
    return (first + second + slack).repeat_interleave(block)[:size]


def assert_within(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (out - exact).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


# ---- 1, 2: one step of every method against the exact mean; bytes per call against the formulas ---

def one_step_worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    C.name_group(group, "dp")
    mine = grads(rank, 0)
    out: dict = {"exact": exact_mean(mine, group), "outputs": {}, "bytes": {}}
    for method in ("none", "fp16", "bf16", "int8", "int4", "torch_fp16", "torch_bf16"):
        hook, state = make_hook(cfg(method), group)
        out["outputs"][method] = step(hook, state, mine)

    for method in CASES:  # bytes of one call per bucket, counter reset in between
        hook, state = make_hook(cfg(method), group)
        if method == "torch_powersgd":  # PyTorch's warm-up (start_powerSGD_iter = 2): exact all-reduces
            out["bytes"]["torch_powersgd_warmup"] = [counted_step(hook, state, mine, SHAPES, ("dp",))[1]
                                                     for _ in range(2)]
        out["bytes"][method] = counted_step(hook, state, mine, SHAPES, ("dp",))[1]

    hook, state = make_hook(cfg("int8"), group)  # the error meter: one extra, uncounted exact all-reduce
    state.measure = True
    C.COUNTER.reset()
    out["measured_outputs"] = step(hook, state, mine)
    out["measured_bytes"] = C.COUNTER.group_bytes("dp")
    out["measured_error"] = state.take_error()
    out["measured_error_after_take"] = state.take_error()

    low = grads(rank, 0, low_rank=RANK // world)  # each rank rank r/n, so the mean has rank <= r
    out["low_exact"] = exact_mean(low, group)
    hook, state = make_hook(cfg("powersgd"), group)
    out["low_powersgd"] = step(hook, state, low)
    hook, state = make_hook(cfg("powersgd", factor_dtype="bf16", error_feedback=False), group)
    out["low_powersgd_bf16"] = [step(hook, state, low) for _ in range(2)]  # a random Q, then a warm one
    hook, state = make_hook(cfg("powersgd", factor_dtype="bf16"), group)
    out["bytes"]["powersgd_bf16"] = counted_step(hook, state, mine, SHAPES, ("dp",))[1]
    for rank_ in (RANK, 2):  # PyTorch orthogonalises with QR above rank 2, Gram-Schmidt at <= 2
        if rank_ // world == 0:
            continue
        per_rank = grads(rank, 0, low_rank=rank_ // world)
        hook, state = make_hook(cfg("torch_powersgd", rank=rank_), group)
        runs = [step(hook, state, per_rank) for _ in range(3)]  # two warm-up steps, then compressed
        out[f"low_torch_powersgd_{rank_}"] = (runs, exact_mean(per_rank, group))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def one_step(request: pytest.FixtureRequest) -> tuple[int, list]:
    return request.param, launched(request.param)["one_step"]


def test_none_is_the_exact_mean(one_step: tuple[int, list]) -> None:
    _, results = one_step
    for r in results:
        for out, exact in zip(r["outputs"]["none"], r["exact"]):
            torch.testing.assert_close(out, exact, rtol=0, atol=0)  # n is a power of two: x/n is exact


@pytest.mark.parametrize("method", list(CAST))
def test_16_bit_casts_within_rounding_bound(one_step: tuple[int, list], method: str) -> None:
    world, results = one_step
    inputs = [grads(r, 0) for r in range(world)]
    for r in results:
        for b, (out, exact) in enumerate(zip(r["outputs"][method], r["exact"])):
            bound = cast_bound([x[b] for x in inputs], CAST[method])
            assert_within(out, exact, bound, f"{method} bucket {b}")
            assert not torch.equal(out, exact), "a 16-bit mean of random data should not be exact"
    for b in range(len(SHAPES)):  # the same value on every rank
        torch.testing.assert_close(results[-1]["outputs"][method][b], results[0]["outputs"][method][b], rtol=0, atol=0)


@pytest.mark.parametrize("method,codec", [("int8", codecs.Int8Codec(BLOCK)), ("int4", codecs.Int4Codec(BLOCK))])
def test_absmax_codecs_within_two_quantisations(one_step: tuple[int, list], method: str,
                                                codec: codecs.Int8Codec) -> None:
    world, results = one_step
    inputs = [grads(r, 0) for r in range(world)]
    for r in results:
        for b, (out, exact) in enumerate(zip(r["outputs"][method], r["exact"])):
            assert_within(out, exact, absmax_bound([x[b] for x in inputs], codec), f"{method} bucket {b}")
        for out, first in zip(r["outputs"][method], results[0]["outputs"][method]):
            torch.testing.assert_close(out, first, rtol=0, atol=0)


def expected_bytes(method: str, shapes: list, n: int) -> int:
    """The payload rule of `method` for one bucket of gradients with `shapes` over n ranks."""
    size = sum(numel(s) for s in shapes)
    if method == "none":
        return 4 * size
    if method in CAST:
        return 2 * size
    if method in codecs.CODECS:  # and the factored scale's statistics, where the method is scaled
        stats = scaling.stats_bytes(shapes) if scaling.scaled(cfg(method), method) else 0
        return codecs.payload_bytes(codecs.CODECS[method].build(cfg(method)), size, n) + stats
    assert method in ("powersgd", "torch_powersgd")  # ours probes its error (adaptive rank, on by default)
    return powersgd.payload_bytes([torch.Size(s) for s in shapes], RANK, MIN_RATE, probed=method == "powersgd")


@pytest.mark.parametrize("method", list(CASES))
def test_bytes_per_call_match_the_payload_formula(one_step: tuple[int, list], method: str) -> None:
    world, results = one_step
    for r in results:
        for b, shapes in enumerate(SHAPES):
            assert r["bytes"][method][b]["dp"] == expected_bytes(method, shapes, world), (method, b)
            if method == "torch_powersgd":
                for warm in r["bytes"]["torch_powersgd_warmup"]:
                    assert warm[b]["dp"] == expected_bytes("none", shapes, world)
    if method != "none":  # every compressed method moves less than fp32
        sizes = [4 * sum(numel(s) for s in shapes) for shapes in SHAPES]
        assert sum(results[0]["bytes"][method][b]["dp"] for b in range(len(SHAPES))) < sum(sizes)


def test_error_meter_reports_the_true_error_uncounted(one_step: tuple[int, list]) -> None:
    world, results = one_step
    for r in results:
        diff = sum(float((o - e).pow(2).sum()) for o, e in zip(r["measured_outputs"], r["exact"]))
        ref = sum(float(e.pow(2).sum()) for e in r["exact"])
        assert diff > 0
        assert r["measured_error"] == pytest.approx((diff, ref), rel=1e-5)
        assert r["measured_error_after_take"] == (0.0, 0.0)
        assert r["measured_bytes"] == sum(expected_bytes("int8", s, world) for s in SHAPES)


def test_powersgd_is_exact_when_the_mean_has_rank_at_most_r(one_step: tuple[int, list]) -> None:
    """Each rank's compressed matrices have rank r/n, so the mean has rank <= r: P = M̄·Q spans M̄'s
    columns and P·Pᵀ·M̄ = M̄. On the first step (random Q), up to fp32 rounding."""
    _, results = one_step
    for r in results:
        for out, exact in zip(r["low_powersgd"], r["low_exact"]):
            torch.testing.assert_close(out, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))


def test_bf16_factors_give_the_mean_within_bf16_rounding_at_half_the_factor_bytes(one_step: tuple[int, list]) -> None:
    """`factor_dtype=bf16`: P and Q summed in bfloat16 (P in an all-reduce of its own) — with a warm Q, the same
    rank-≤-r mean up to a few of bf16's roundings (ε = 2⁻⁷ of the largest element); identical on every rank; the
    factors counted at 2 bytes an element (the exact tensors and probes at 4). The first step's Q is random: P = M̄·Q
    can be ill-conditioned there, and rounding P moves its span by ε·κ(P) (up to ~7 % here), which error feedback
    carries to the next step."""
    world, results = one_step
    eps = torch.finfo(torch.bfloat16).eps
    for r in results:
        for out, exact in zip(r["low_powersgd_bf16"][1], r["low_exact"]):
            torch.testing.assert_close(out, exact, rtol=0, atol=4 * eps * float(exact.abs().max()))
        for b, shapes in enumerate(SHAPES):
            sizes = [torch.Size(s) for s in shapes]
            assert r["bytes"]["powersgd_bf16"][b]["dp"] == powersgd.payload_bytes(sizes, RANK, MIN_RATE, probed=True,
                                                                                 factor_bytes=2)
    assert sum(b["dp"] for b in results[0]["bytes"]["powersgd_bf16"]) < sum(
        b["dp"] for b in results[0]["bytes"]["powersgd"])
    for r in results[1:]:
        for mine, first in zip(r["low_powersgd_bf16"], results[0]["low_powersgd_bf16"]):
            assert all(torch.equal(a, b) for a, b in zip(mine, first))


@pytest.mark.parametrize("rank_", [RANK, 2], ids=["qr", "gram_schmidt"])
def test_torch_powersgd_is_exact_after_warmup_on_low_rank(one_step: tuple[int, list], rank_: int) -> None:
    """PyTorch's hook: exact all-reduce for 2 steps, then its first compressed step is exact too.

    Both of its orthogonalisations reproduce a rank-<= r mean (checked here): QR (rank > 2) and its
    Gram-Schmidt (rank <= 2, epsilon 0), the latter at dp=2 only, where each rank's part has rank 1."""
    world, results = one_step
    if rank_ // world == 0:
        pytest.skip("rank r/n would be 0")
    for r in results:
        runs, exact = r[f"low_torch_powersgd_{rank_}"]
        for s, outs in enumerate(runs):
            for out, e in zip(outs, exact):
                torch.testing.assert_close(out, e, rtol=0, atol=(1e-6 if s < 2 else 1e-5) * float(e.abs().max()))


# ---- 1: error feedback over many steps -----------------------------------------------------------

def error_feedback_worker(rank: int, world: int) -> dict:
    """‖Σ_t ĝ_t − Σ_t g_t‖ and ‖Σ_t g_t‖ per step, for each EF method with and without feedback.

    One bucket holding all of SHAPES (fewer collectives per step). The true mean g_t is computed here
    from every rank's seeded gradients (fp64, no collective), once for every method."""
    group = dist.new_group(list(range(world)))
    mine = [grads(rank, t, EF_SHAPES) for t in range(EF_STEPS)]
    true = torch.zeros(sum(sum(numel(s) for s in b) for b in SHAPES), dtype=torch.float64)
    true_sums = []
    for t in range(EF_STEPS):
        true = true + sum(grads(r, t, EF_SHAPES)[0].double() for r in range(world)) / world
        true_sums.append(true)
    total = [float(x.norm()) for x in true_sums]
    out = {}
    for method in EF_METHODS:
        for feedback in (True, False):
            hook, state = make_hook(cfg(method, error_feedback=feedback), group)
            applied = torch.zeros_like(true)
            gap = []
            for t in range(EF_STEPS):
                applied = applied + step(hook, state, mine[t], EF_SHAPES)[0].double()
                gap.append(float((applied - true_sums[t]).norm()))
            out[(method, feedback)] = (gap, total)
    return out


@pytest.fixture(scope="module")
def error_feedback() -> list:
    """At dp=2: how many ranks average the codes is not what feedback changes (each codec's dp=4 step is
    checked above), and its 300 steps of exchanges on 4 ranks cost more than every other dp=4 check together."""
    return launched(2)["error_feedback"]


@pytest.mark.parametrize("method", EF_METHODS)
def test_error_feedback_tracks_the_true_sum(error_feedback: list, method: str) -> None:
    """With feedback the gap between applied and true sums stays bounded while ‖Σg‖ grows like √t;
    without it, the gap grows like √t too (independent errors add up)."""
    for r in error_feedback:
        gap, total = r[(method, True)]
        gap_off, _ = r[(method, False)]
        assert total[EF_STEPS - 1] > 1.8 * total[9]  # √5 ≈ 2.2: the true sum keeps growing
        assert max(gap[9:]) < 1.4 * gap[9], f"EF gap grows: {gap[9]:.3g} → {max(gap[9:]):.3g}"
        assert gap_off[EF_STEPS - 1] > 1.8 * gap_off[9], "without feedback the gap should grow like √t"
        assert gap[EF_STEPS - 1] < 0.5 * gap_off[EF_STEPS - 1]
    finals = [r[(method, True)][0][-1] for r in error_feedback]
    assert finals == [finals[0]] * len(finals)  # every rank applied the same updates


# ---- 3: state_dict round trip and warm-up -----------------------------------------------------------

def dp_groups(layout: Layout, rank: int) -> tuple:
    """This rank's (dp, dp_intra, dp_inter) groups from the layout's rank lists, named for the counter,
    as `ParallelContext.build` makes them (every rank joins every `new_group` call, in order), but
    without the TP / PP / embedding groups a DP-only test does not use (world 8: 7 groups, not 31)."""
    mine = []
    for name, lists in (("dp", layout.dp_groups()), ("dp_intra", layout.dp_intra_node_groups()),
                        ("dp_inter", layout.dp_inter_node_groups())):
        found = None
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                found = group
        C.name_group(found, name, layout.per_node(lists[0]))
        mine.append(found)
    return tuple(mine)


def roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


STATEFUL = {"sign": {}, "topk": {}, "powersgd": {}, "torch_powersgd": {},
            "hierarchical": {"inner": "powersgd", "rank": RANK}}


def state_worker(rank: int, world: int) -> dict:
    """k steps, save; a fresh (hook, state) loads the save; both run on → their outputs, and a control
    (fresh, nothing loaded). On emulated nodes of 2 ranks so hierarchical has a node to cut."""
    groups = dp_groups(Layout.create(world, dp=world, ranks_per_node=2), rank)
    dp_group = groups[0]
    shapes = HIER_SHAPES
    out: dict = {}
    for method, extra in STATEFUL.items():
        config = cfg(method, **extra)
        hook, state = make_hook(config, *groups)
        for t in range(3):
            step(hook, state, grads(rank, t, shapes), shapes)
        saved = roundtrip(state.state_dict())
        resumed_hook, resumed = make_hook(config, *groups)
        resumed.load_state_dict(saved)
        fresh_hook, fresh = make_hook(config, *groups)
        runs: dict = {"uninterrupted": [], "resumed": [], "fresh": []}
        for t in range(3, 6):
            bufs = grads(rank, t, shapes)
            runs["uninterrupted"].append(step(hook, state, bufs, shapes))
            runs["resumed"].append(step(resumed_hook, resumed, bufs, shapes))
            runs["fresh"].append(step(fresh_hook, fresh, bufs, shapes))
        out[method] = runs
    try:
        make_hook(cfg("topk"), *groups)[1].load_state_dict(roundtrip(make_hook(cfg("sign"), *groups)[1].state_dict()))
        out["wrong_method"] = "loaded"
    except ValueError as e:
        out["wrong_method"] = str(e)

    for method, extra in (("sign", {"warmup_steps": 2}), ("torch_powersgd", {})):  # both: 2 exact steps
        hook, state = make_hook(cfg(method, **extra), dp_group)
        runs = []
        for t in range(3):
            bufs = grads(rank, t, shapes)
            runs.append((step(hook, state, bufs, shapes), exact_mean(bufs, dp_group)))
        out[f"warmup_{method}"] = runs
    out["warmup_codec"] = warmup_codec_runs(rank, dp_group, HIER_SHAPES)
    return out


def warmup_codec_runs(rank: int, group: dist.ProcessGroup, shapes: list) -> dict:
    """PowerSGD warmed up for 4 steps in int4 (error feedback: residuals to resume), beside plain int4; saved after
    step 2 and resumed. → (warmed, int4) and (warmed, resumed) outputs per step."""
    warm = cfg("powersgd", warmup_steps=4, warmup_method="int4", block_size=BLOCK)
    (hook, state), (int4_hook, int4_state) = make_hook(warm, group), make_hook(cfg("int4"), group)
    pairs, resumed_pairs, resumed_hook, resumed = [], [], None, None
    for t in range(6):
        if t == 2:
            resumed_hook, resumed = make_hook(warm, group)
            resumed.load_state_dict(roundtrip(state.state_dict()))
        bufs = grads(rank, t, shapes)
        out = step(hook, state, bufs, shapes)
        pairs.append((out, step(int4_hook, int4_state, bufs, shapes)))
        if resumed is not None:
            resumed_pairs.append((out, step(resumed_hook, resumed, bufs, shapes)))
    return {"pairs": pairs, "resumed": resumed_pairs, "methods": [state.method_at(t) for t in (0, 3, 4)]}


@pytest.fixture(scope="module")
def state_runs() -> list:
    return launched(4)["state"]


@pytest.mark.parametrize("method", list(STATEFUL))
def test_state_dict_resumes_bit_identically(state_runs: list, method: str) -> None:
    for r in state_runs:
        runs = r[method]
        for t, (a, b) in enumerate(zip(runs["uninterrupted"], runs["resumed"])):
            for i, (x, y) in enumerate(zip(a, b)):
                torch.testing.assert_close(y, x, rtol=0, atol=0, msg=f"{method} step {t + 3} bucket {i}")
        # the saved state matters: starting from scratch gives other outputs
        assert any(not torch.equal(x, y) for a, b in zip(runs["uninterrupted"], runs["fresh"]) for x, y in zip(a, b))


def test_loading_another_methods_state_is_refused(state_runs: list) -> None:
    assert "compression=sign" in state_runs[0]["wrong_method"]


@pytest.mark.parametrize("method", ["sign", "torch_powersgd"])
def test_warmup_steps_are_the_exact_all_reduce(state_runs: list, method: str) -> None:
    for r in state_runs:
        runs = r[f"warmup_{method}"]
        for t in range(2):
            for out, exact in zip(*runs[t]):
                torch.testing.assert_close(out, exact, rtol=0, atol=0, msg=f"{method} warm-up step {t}")
        assert any(not torch.equal(out, exact) for out, exact in zip(*runs[2])), "step 2 should be compressed"


def test_a_warm_up_codec_runs_its_steps_resumes_them_and_hands_over_to_the_method(state_runs: list) -> None:
    for r in state_runs:
        runs = r["warmup_codec"]
        for t, (warmed, int4) in enumerate(runs["pairs"]):
            same = all(torch.equal(a, b) for a, b in zip(warmed, int4))
            assert same == (t < 4), f"step {t}: the warm-up is int4's, bit for bit, then PowerSGD's"
        for t, (warmed, resumed) in enumerate(runs["resumed"]):
            assert all(torch.equal(a, b) for a, b in zip(warmed, resumed)), f"resumed at step 2, step {t + 2}"
        assert runs["methods"] == ["int4", "int4", "powersgd"]


# ---- 4: under torch's DDP; PyTorch's hooks under GradSync ----------------------------------------------

def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8))


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * t + rank)  # each rank its own data
    return torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)


DDP_METHODS = ("none", "fp16", "bf16", "int8", "sign", "topk", "powersgd")


def ddp_worker(rank: int, world: int) -> dict:
    """Our (hook, state) registered on plain DDP; 3 SGD steps (DDP rebuilds its buckets after the
    first). Per step: the synced grads, this rank's local grads (a replica without DDP) and the exact
    mean, and each bucket's hook input with its parameter names."""
    group = dist.new_group(list(range(world)))
    out: dict = {}
    for method in DDP_METHODS:
        model = net()
        replica = copy.deepcopy(model)
        name_of = {id(p): n for n, p in model.named_parameters()}
        hook, state = make_hook(cfg(method), group)
        if method == DDP_METHODS[0]:
            probe = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=group)
            try:  # the contract: make_hook's pair registers on DDP as it is
                probe.register_comm_hook(state, hook)
                out["register_error"] = None
            except Exception as e:  # noqa: BLE001  (reported by test_make_hook_pair_registers_on_torch_ddp)
                out["register_error"] = f"{type(e).__name__}: {e}"
            del probe
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.002)
        buckets: list = []

        def recording(st, bucket, hook=hook, buckets=buckets, name_of=name_of):  # the same hook, recording inputs
            buckets.append(([name_of[id(p)] for p in bucket.parameters()], bucket.buffer().clone()))
            return hook(st, bucket)

        ddp.register_comm_hook(state, recording)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = []
        for t in range(3):
            x, y = batch(rank, t)
            replica.load_state_dict(model.state_dict())
            F.mse_loss(replica(x), y).backward()
            local = {n: p.grad.clone() for n, p in replica.named_parameters()}
            replica.zero_grad()
            buckets.clear()
            F.mse_loss(ddp(x), y).backward()
            exact = {}
            for n, g in local.items():
                exact[n] = g.clone()
                dist.all_reduce(exact[n], group=group)
                exact[n] /= world
            synced = {n: p.grad.clone() for n, p in model.named_parameters()}
            steps.append({"synced": synced, "local": local, "exact": exact, "buckets": list(buckets)})
            opt.step()
            opt.zero_grad()
        out[method] = {"steps": steps, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def ddp_runs() -> list:
    return launched(2)["ddp"]


def per_parameter(bucket_values: list, names_per_bucket: list, numels: dict) -> dict:
    """Split flat per-bucket tensors back into parameters (a DDP bucket is its parameters in order)."""
    out = {}
    for flat, names in zip(bucket_values, names_per_bucket):
        offset = 0
        for n in names:
            out[n] = flat[offset: offset + numels[n]]
            offset += numels[n]
    return out


def test_make_hook_pair_registers_on_torch_ddp(ddp_runs: list) -> None:
    """`ddp.register_comm_hook(state, hook)` with make_hook's pair, as the hooks module promises."""
    assert ddp_runs[0]["register_error"] is None


@pytest.mark.parametrize("method", ["none", "fp16", "bf16", "int8"])
def test_our_hooks_in_torch_ddp_give_the_mean(ddp_runs: list, method: str) -> None:
    assert len(ddp_runs[0][method]["steps"][-1]["buckets"]) >= 2, "the test wants several DDP buckets"
    for t in range(3):
        ranks = [r[method]["steps"][t] for r in ddp_runs]
        numels = {n: g.numel() for n, g in ranks[0]["local"].items()}
        if method == "int8":  # the bound depends on the blocks, i.e. on DDP's bucket layout
            names = [b[0] for b in ranks[0]["buckets"]]
            assert all([b[0] for b in s["buckets"]] == names for s in ranks)
            inputs = [[b[1] for b in s["buckets"]] for s in ranks]
            int8 = codecs.Int8Codec(BLOCK)
            bounds = per_parameter([absmax_bound(list(per_bucket), int8) for per_bucket in zip(*inputs)], names, numels)
        for s in ranks:
            for n, exact in s["exact"].items():
                got = s["synced"][n]
                if method == "none":
                    torch.testing.assert_close(got, exact, rtol=0, atol=0, msg=n)  # 2 ranks: a + b either way
                elif method == "int8":
                    assert_within(got.reshape(-1), exact.reshape(-1), bounds[n], f"int8 step {t} {n}")
                else:
                    bound = cast_bound([o["local"][n] for o in ranks], CAST[method])
                    assert_within(got.reshape(-1), exact.reshape(-1), bound.reshape(-1), f"{method} step {t} {n}")


@pytest.mark.parametrize("method", ["sign", "topk", "powersgd"])
def test_error_feedback_hooks_train_in_torch_ddp(ddp_runs: list, method: str) -> None:
    a, b = (r[method] for r in ddp_runs)
    for t, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
        for n, g in sa["synced"].items():
            assert torch.isfinite(g).all()
            torch.testing.assert_close(sb["synced"][n], g, rtol=0, atol=0, msg=f"step {t} {n}")
            assert not torch.equal(g, sa["local"][n]), "the synced gradient is not this rank's own"
    for n, p in a["params"].items():
        torch.testing.assert_close(b["params"][n], p, rtol=0, atol=0)


def torch_hooks_worker(rank: int, world: int) -> dict:
    """PyTorch's hooks under GradSync: torch_fp16 next to DDP with fp16_compress_hook, and
    torch_powersgd for 4 SGD steps (2 warm-up, 2 compressed) with the exact mean alongside."""
    group = dist.new_group(list(range(world)))
    C.name_group(group, "dp")
    out: dict = {}
    model = net()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=group, bucket_cap_mb=0.002)
    ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    hook, state = make_hook(cfg("torch_fp16"), group)
    sync = GradSync(list(model.parameters()), group, hook, state, bucket_mb=0.002)
    out["buckets"] = len(sync.buckets)
    for t in range(2):
        x, y = batch(rank, t)
        sync.begin_step(1)
        F.mse_loss(model(x), y).backward()
        sync.finish()
        F.mse_loss(ddp(x), y).backward()
        out[f"fp16_{t}"] = ({n: p.grad.clone() for n, p in model.named_parameters()},
                            {n.removeprefix("module."): p.grad.clone() for n, p in ddp.named_parameters()})
        sync.zero_grad()
        ddp.zero_grad()

    model = net()
    replica = copy.deepcopy(model)
    hook, state = make_hook(cfg("torch_powersgd"), group)
    sync = GradSync(list(model.parameters()), group, hook, state, bucket_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for t in range(4):
        x, y = batch(rank, t)
        replica.load_state_dict(model.state_dict())
        F.mse_loss(replica(x), y).backward()
        sync.begin_step(1)
        F.mse_loss(model(x), y).backward()
        sync.finish()
        exact = {}
        for n, p in replica.named_parameters():
            exact[n] = p.grad.clone()
            dist.all_reduce(exact[n], group=group)
            exact[n] /= world
        replica.zero_grad()
        steps.append(({n: p.grad.clone() for n, p in model.named_parameters()}, exact))
        opt.step()
        sync.zero_grad()
    out["powersgd"] = steps
    out["powersgd_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def torch_hook_runs() -> list:
    return launched(2)["torch_hooks"]


def test_torch_fp16_hook_in_gradsync_equals_torch_ddp(torch_hook_runs: list) -> None:
    assert torch_hook_runs[0]["buckets"] >= 2
    for r in torch_hook_runs:
        for t in range(2):
            ours, theirs = r[f"fp16_{t}"]
            for n, g in theirs.items():  # elementwise cast → ÷2 → fp16 sum of 2 terms: layout-independent
                torch.testing.assert_close(ours[n], g, rtol=0, atol=0, msg=f"step {t} {n}")


def test_torch_powersgd_hook_in_gradsync_trains_identically_on_every_rank(torch_hook_runs: list) -> None:
    a, b = torch_hook_runs
    for t, ((ga, exact), (gb, _)) in enumerate(zip(a["powersgd"], b["powersgd"])):
        for n, g in ga.items():
            assert torch.isfinite(g).all()
            torch.testing.assert_close(gb[n], g, rtol=0, atol=0, msg=f"step {t} {n}")
            if t < 2:  # warm-up: PyTorch's exact all-reduce
                torch.testing.assert_close(g, exact[n], rtol=1e-6, atol=1e-7, msg=f"warm-up step {t} {n}")
        if t >= 2:
            assert any(not torch.allclose(g, exact[n], rtol=1e-3, atol=1e-5) for n, g in ga.items())
    for n, p in a["powersgd_params"].items():
        torch.testing.assert_close(b["powersgd_params"][n], p, rtol=0, atol=0)


# ---- PowerSGD on buckets with nothing to compress (biases, norms, small matrices) ---------------------

def bias_bucket_worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    out = {}
    for name, shapes in (("bias only", [[(48,)]]), ("small matrix", [[(3, 100), (3,)]])):
        bufs = grads(rank, 0, shapes)
        hook, state = make_hook(cfg("powersgd"), group)
        out[name] = (step(hook, state, bufs, shapes), exact_mean(bufs, group))
    return out


def test_powersgd_sends_a_bucket_without_compressible_matrix_exactly() -> None:
    """A bucket holding only biases or norms (or matrices too small to compress at rank r) is sent as
    it is: the exact mean (PyTorch's powerSGD_hook handles this case)."""
    for r in launched(2)["bias"]:
        for name, (outs, exact) in r.items():
            for out, e in zip(outs, exact):
                torch.testing.assert_close(out, e, rtol=1e-6, atol=1e-7, msg=name)


# ---- the block codecs' column layout of row-parallel weights (`compression.block_layout`) ----------------

COL_SHAPE, COL_STEPS = (64, 96), 3


def column_grads(rank: int, step: int) -> torch.Tensor:
    """A row-parallel weight's gradient (its columns' scales 10^±3 apart, as a SwiGLU input's channels) and a
    bias, flat."""
    scales = 10.0 ** (torch.rand(COL_SHAPE[1], generator=torch.Generator().manual_seed(step)) * 6 - 3)  # the model's
    gen = torch.Generator().manual_seed(10_007 * step + rank)
    return torch.cat([(torch.randn(COL_SHAPE, generator=gen) * scales).reshape(-1), torch.randn(8, generator=gen)])


def columns_worker(rank: int, world: int) -> dict:
    """Per method, per layout, COL_STEPS steps on one bucket [flagged weight, bias]; the reference: the rows
    layout on the weight's transpose (an unflagged [96, 16] parameter), transposed back."""
    group = dist.new_group(list(range(world)))
    out: dict = {}
    for method in ("sign", "int4", "onebit_adam"):
        runs: dict = {"exact": [], "auto": [], "rows": [], "reference": []}
        warm = int(method == "onebit_adam")  # its momentum exchange runs whatever the stage: the optimizer's call
        hooks = {k: make_hook(cfg(method, block_layout="rows" if k == "rows" else "auto", warmup_steps=warm,
                                  block_size=BLOCK, scale="none"), group) for k in ("auto", "rows", "reference")}
        for t in range(COL_STEPS):
            flat = column_grads(rank, t)
            runs["exact"].append(exact_mean([flat], group)[0])
            for k, (hook, state) in hooks.items():
                runs[k].append(column_step(k, hook, state, flat))
        out[method] = runs
    return out


def column_step(kind: str, hook: object, state: object, flat: torch.Tensor) -> torch.Tensor:
    """One step of `kind`'s hook (1-bit Adam: its momentum exchange on `flat`, the step's buffer), as laid out."""
    from hybrid.compression.onebit_adam import average_momentum

    weight = nn.Parameter(torch.empty(COL_SHAPE[::-1] if kind == "reference" else COL_SHAPE))
    weight.hybrid = ParamInfo(column_blocks=kind != "reference")  # what `RowParallelLinear` sets
    buf = flat.clone()
    if kind == "reference":
        buf[: weight.numel()] = buf[: weight.numel()].view(COL_SHAPE).t().reshape(-1)
    bucket = GradBucket(0, buf, [weight, nn.Parameter(torch.empty(8))], True)
    if state.method == "onebit_adam":
        average_momentum(state, [(bucket.buffer(), bucket)])
        result = bucket.buffer()
    else:
        result = value(hook(state, bucket))
    if kind == "reference":
        result[: weight.numel()] = result[: weight.numel()].view(COL_SHAPE[::-1]).t().reshape(-1)
    return result.clone()


@pytest.mark.parametrize("method", ["sign", "int4", "onebit_adam"])
def test_column_layout_is_the_codec_on_the_transpose_and_fits_heavy_columns(method: str) -> None:
    """Under `block_layout=auto` a flagged weight is compressed as its transpose, bit for bit and across steps
    (the residuals of error feedback stay in that layout); with its columns' scales 10^±3 apart its error, each
    column's against its own scale, is lower than laid out by rows (a block of 32 spans 32 channels' scales there,
    one channel's here)."""
    for r in launched(2)["columns"]:
        runs = r[method]
        for auto, ref in zip(runs["auto"], runs["reference"]):
            assert torch.equal(auto, ref)
        error = {k: column_error(runs[k][0], runs["exact"][0]) for k in ("auto", "rows")}  # the first step's
        assert error["auto"] < 0.5 * error["rows"], error


def column_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    """The weight's error as Adam sees it: each column's relative error (its own scale), the mean over columns."""
    n = math.prod(COL_SHAPE)
    v, e = value[:n].view(COL_SHAPE), exact[:n].view(COL_SHAPE)
    return float(((v - e).norm(dim=0) / e.norm(dim=0)).mean())


# ---- 5: hierarchical on 2 emulated nodes of 4 ranks ------------------------------------------------------

HIER_SHAPES = [[(64, 48), (48,)], [(48, 32), (32,), (16, 8, 4)]]
"""Every one of the 4 row ranges of each bucket holds a block of rows PowerSGD compresses at rank 4."""
HIER_CASES = {"none": {}, "int8": {"block_size": BLOCK}, "powersgd": {"rank": RANK, "factor_dtype": "fp32"}}
NODE = 4


def hierarchical_worker(rank: int, world: int) -> dict:
    dp, intra, inter = dp_groups(Layout.create(world, tp=1, pp=1, dp=world, ranks_per_node=NODE), rank)
    out: dict = {"local_index": dist.get_rank(intra)}
    for inner, extra in HIER_CASES.items():
        bufs = grads(rank, 0, HIER_SHAPES, low_rank=RANK if inner == "powersgd" else 0, shared_basis=True)
        exact = exact_mean(bufs, dp)
        hook, state = make_hook(cfg("hierarchical", inner=inner, **extra), dp, intra, inter)
        outs, counted = counted_step(hook, state, bufs, HIER_SHAPES, ("dp", "dp_intra", "dp_inter"))
        out[inner] = {"outputs": outs, "exact": exact, "bytes": counted}
    return out


@pytest.fixture(scope="module")
def hierarchical_runs() -> list:
    return launched(2 * NODE)["hierarchical"]


def inner_bytes(inner: str, piece: list, n: int) -> int:
    size = sum(s.numel() for s in piece)
    if inner == "none":
        return 4 * size
    if inner == "int8":
        return codecs.payload_bytes(codecs.Int8Codec(BLOCK), size, n)
    return powersgd.payload_bytes(piece, RANK, MIN_RATE, probed=True)


@pytest.mark.parametrize("inner", list(HIER_CASES))
def test_hierarchical_bytes_exact_inside_compressed_between(hierarchical_runs: list, inner: str) -> None:
    for rank, r in enumerate(hierarchical_runs):
        j = r["local_index"]
        assert j == rank % NODE
        for b, shapes in enumerate(HIER_SHAPES):
            sizes = [torch.Size(s) for s in shapes]
            ranges = row_ranges(sizes, NODE)
            longest = max(hi - lo for lo, hi in ranges)
            counted = r[inner]["bytes"][b]
            assert counted["dp_intra"] == 2 * 4 * NODE * longest  # reduce-scatter in + all-gather out, fp32
            assert counted["dp_inter"] == inner_bytes(inner, piece_shapes(sizes, ranges[j]), 2)
            assert counted["dp"] == 0


@pytest.mark.parametrize("inner", list(HIER_CASES))
def test_hierarchical_gives_the_mean(hierarchical_runs: list, inner: str) -> None:
    world = len(hierarchical_runs)
    low = RANK if inner == "powersgd" else 0
    inputs = [grads(r, 0, HIER_SHAPES, low_rank=low, shared_basis=True) for r in range(world)]
    for r in hierarchical_runs:
        for b, (out, exact) in enumerate(zip(r[inner]["outputs"], r[inner]["exact"])):
            scale = float(exact.abs().max())
            if inner == "none":  # sums in another order than one all-reduce: n − 1 fp32 roundings on each side
                bound = 2 * world * (torch.finfo(torch.float32).eps / 2) * sum(x[b].abs() for x in inputs) / world
                assert_within(out, exact, bound, f"hierarchical none bucket {b}")
            elif inner == "powersgd":  # the mean's row blocks have rank <= 4: exact up to rounding
                torch.testing.assert_close(out, exact, rtol=0, atol=1e-5 * scale)
            else:  # int8 between the 2 nodes on each range of node sums, then ÷ 4
                bound = torch.empty_like(exact)
                sizes = [torch.Size(s) for s in HIER_SHAPES[b]]
                for lo, hi in row_ranges(sizes, NODE):
                    node_sums = [sum(x[b][lo:hi] for x in inputs[k * NODE:(k + 1) * NODE]) for k in range(2)]
                    bound[lo:hi] = absmax_bound(node_sums, codecs.Int8Codec(BLOCK)) / NODE
                bound += 1e-6 * scale  # the intra-node sums' own rounding
                assert_within(out, exact, bound, f"hierarchical int8 bucket {b}")
    first = hierarchical_runs[0][inner]["outputs"]
    for r in hierarchical_runs:  # the same value on every rank
        for out, ref in zip(r[inner]["outputs"], first):
            torch.testing.assert_close(out, ref, rtol=0, atol=0)


class ExactCodec:
    """A codec that sends the fp32 bytes themselves: the two hops' placement, without a codec's rounding."""

    def chunk_len(self, n: int) -> int:
        return n

    def encoded_bytes(self, length: int) -> int:
        return 4 * length

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, length: int) -> torch.Tensor:
        return data.view(torch.float32)


QGZ_NUMEL = 8 * 3 * BLOCK  # a bucket of 8 shards of 3 int8 blocks
QGZ_ROUNDS = 20


def qgz_worker(rank: int, world: int) -> dict:
    """ZeRO's two-hop reduce-scatter (qgZ) of one bucket over dp=8 on 2 nodes of 4: exact and int8 across."""
    dp, intra, inter = dp_groups(Layout.create(world, tp=1, pp=1, dp=world, ranks_per_node=NODE), rank)
    out: dict = {"exact": exact_mean([torch.randn(QGZ_NUMEL, generator=torch.Generator().manual_seed(r))
                                      for r in [rank]], dp)[0] * world}
    for name, codec in (("fp32", ExactCodec()), ("int8", codecs.Int8Codec(BLOCK))):
        buf = torch.randn(QGZ_NUMEL, generator=torch.Generator().manual_seed(rank))
        C.COUNTER.reset()
        mine = TwoHop(codec, intra, inter)(buf, dp).clone()
        out[name] = {"shard": mine, "bytes": dict(C.COUNTER.bytes),
                     "cross": {g: C.COUNTER.cross_node_bytes(g) for g in ("dp", "dp_intra", "dp_inter")}}
    for feedback in (False, True):  # QGZ_ROUNDS rounds of the same bucket, int4 across: the sum of what arrived
        hop = TwoHop(codecs.Int4Codec(BLOCK), intra, inter, feedback)
        total = torch.zeros(QGZ_NUMEL // world)
        for _ in range(QGZ_ROUNDS):
            total += hop(torch.randn(QGZ_NUMEL, generator=torch.Generator().manual_seed(rank)), dp, 3)
        out[f"rounds feedback={feedback}"] = total
    return out


@pytest.fixture(scope="module")
def qgz_runs() -> list:
    return launched(2 * NODE)["qgz"]


def test_qgz_reduce_scatter_leaves_each_rank_its_shard_of_the_sum(qgz_runs: list) -> None:
    """With the fp32 bytes as the codec the two hops are a reduce-scatter: shard s of the sum on dp rank s (up to
    the sums' order); with int8 across, within int8's rounding of the node sums."""
    world = len(qgz_runs)
    k = QGZ_NUMEL // world
    inputs = [torch.randn(QGZ_NUMEL, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for rank, r in enumerate(qgz_runs):
        exact = r["exact"][rank * k: (rank + 1) * k]
        torch.testing.assert_close(r["fp32"]["shard"], exact, rtol=0, atol=1e-5)
        node_sums = [sum(x[rank * k: (rank + 1) * k] for x in inputs[n * NODE:(n + 1) * NODE]) for n in range(2)]
        bound = absmax_bound(node_sums, codecs.Int8Codec(BLOCK)) * 2 + 1e-5
        assert_within(r["int8"]["shard"], exact, bound, f"qgZ int8 shard of rank {rank}")
        assert 0 < (r["int8"]["shard"] - exact).abs().max()


def test_qgz_bytes_are_fp32_inside_the_node_and_the_codecs_payload_of_a_node_share_across(qgz_runs: list) -> None:
    """Inside the node one fp32 reduce-scatter of the bucket; across the nodes an all-to-all of the encoded
    quarter (a node's share), half of which leaves the node; nothing on the flat DP group."""
    codec = codecs.Int8Codec(BLOCK)
    part = QGZ_NUMEL // NODE
    for r in qgz_runs:
        sent = 2 * codec.encoded_bytes(codec.chunk_len(part // 2))
        assert r["int8"]["bytes"] == {("dp_intra", "reduce_scatter"): 4 * QGZ_NUMEL, ("dp_inter", "all_to_all"): sent}
        assert r["int8"]["cross"] == {"dp": 0, "dp_intra": 0, "dp_inter": sent / 2}


def test_qgz_error_feedback_keeps_the_sum_of_rounds_within_one_rounds_error(qgz_runs: list) -> None:
    """With error feedback what the across hop's int4 encoding loses is sent in a later round: over 20 rounds of
    the same bucket the sum received is the exact sum less the last residual (within one round's error), where
    without it the same rounding error adds up round after round."""
    k = QGZ_NUMEL // len(qgz_runs)
    for rank, r in enumerate(qgz_runs):
        want = QGZ_ROUNDS * r["exact"][rank * k: (rank + 1) * k]
        plain = (r["rounds feedback=False"] - want).abs().max()
        fed = (r["rounds feedback=True"] - want).abs().max()
        one_round = (r["fp32"]["shard"] - r["exact"][rank * k: (rank + 1) * k]).abs().max() + plain / QGZ_ROUNDS
        assert fed < 2 * one_round and fed < plain / 4, (rank, float(fed), float(plain))
