"""Megatron-style mixed precision (`train.precision=bf16_params`) on gloo ranks against references.

One world-4 launch trains a 4-layer model's bf16 parameters at dp4 (plain optimizer and ZeRO-1), tp2 pp2
(1F1B: bf16 hidden states between stages), tp2dp2 with sequence parallelism and ZeRO-1, interleaved pp2dp2 with
ZeRO-1, and the fp32 tp2 pp2 run beside them. References: the single-process bf16-parameter run (every layout reaches
the same losses and weights within bf16's rounding of a weight: the fp32 main weights differ by fp32
round-off between layouts, and one rounding of a bf16 weight more or less is 2⁻⁸ relative); the traffic
formulas at 2-byte activations and residual stream, and the fp32 run's own byte counts (the pipeline's bytes
halve, DP gradient traffic stays fp32, ZeRO-1's all-gather halves); ZeRO-1 against the plain optimizer.
In one process: 25 steps of a 2-layer model track fp32 training; the main gradients accumulate in fp32.

A second launch checkpoints a ZeRO-1 bf16-parameter run (2 layers) at dp4 and resumes it at dp4 (bit for bit), at tp2
dp2 with and without ZeRO-1; the files hold the fp32 main weights (more than bf16's information), which an
fp32 run resumes (`checkpoint.allow_changes=true`) as its weights exactly.

Both launches' configs are composed in the test process before the ranks fork (`compose_config`'s memo), whose
heap is frozen while they run (`run_frozen`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from pp_helpers import MICRO, TIMEOUT, VOCAB, Case, make_cfg, stage_states, train_case, train_cases
from test_checkpoint import SAVE_AT, STEPS, _cfg, _resume, _saved, _train, _weights, resume_cfgs, resume_runs
from test_dp import SEQ
from tp_helpers import run_frozen

from hybrid.checkpoint import load_weights, step_path
from hybrid.model.traffic import pp_bytes_per_step, tp_bytes_per_step
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.data import GradSync
from hybrid.trainer import build_chunks

BF16 = ("train.precision=bf16_params",)
L4 = ("model.n_layers=4",)  # the launch's model: a layer per part of the interleaved pp2 × 2
L2 = ("model.n_layers=2",)  # the checkpoint's
LOW = (*BF16, *L4)
ZERO2_LOW = Case(pp=2, zero=2, extra=LOW)
ZERO3_LOW = Case(tp=2, sp=True, zero=3, extra=LOW)
CASES = [Case(extra=LOW), Case(zero=1, extra=LOW), Case(tp=2, pp=2, extra=LOW),
         Case(tp=2, sp=True, zero=1, extra=LOW), Case(pp=2, schedule="interleaved", v=2, zero=1, extra=LOW),
         ZERO2_LOW, ZERO3_LOW, Case(tp=2, pp=2, extra=L4)]
WORLD = 4
LOSS_TOL = {"rtol": 2e-3, "atol": 2e-3}  # the losses of one model whose bf16 weights differ by an ulp here and there
UPDATE_TOL = (0.4, 0.15)  # ‖w − w_ref‖ / ‖w_ref − w_0‖ per parameter, whole model (measured: 0.27, 0.05 at tp2)
VOCAB_ROWS = ("tok_embed.weight", "head.weight")
TRACK_STEPS = 25  # past Adam's warm-up into steady learning; a 2-layer model: depth adds only more of the same
TRACK_TOL = 1e-2  # bf16 parameters against fp32 training, relative loss gap at any step


@functools.cache
def launched() -> dict[str, list[dict[str, Any]]]:
    torch.set_num_threads(1)
    for case in CASES:  # composed here once, inherited by the forked ranks
        make_cfg(case, WORLD)
    results = run_frozen(train_cases, WORLD, CASES, timeout=TIMEOUT)
    return {str(c): [r[i] for r in results] for i, c in enumerate(CASES)}


@functools.cache
def single() -> dict[str, Any]:
    torch.set_num_threads(1)
    return train_case(ParallelContext.single(), Case(extra=LOW), 1)


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The stages' weights together; a tied head (the last stage's copy of the embedding) left out."""
    out: dict[str, torch.Tensor] = {}
    for s in stage_states(results):
        out.update(s)
    if "head.weight" not in single()["state"]:
        out.pop("head.weight", None)
    return out


@functools.cache
def initial() -> dict[str, torch.Tensor]:
    """The weights every run starts from (the same seed under any layout)."""
    model = build_chunks(make_cfg(Case(extra=LOW), 1), VOCAB, ParallelContext.single())
    return {name: t[:VOCAB] if name in VOCAB_ROWS else t for name, t in model[0].state_dict().items()}


@pytest.mark.parametrize("case", CASES[:-1], ids=str)
def test_bf16_params_match_the_single_process_run(case: Case) -> None:
    """Plain data parallelism is bit for bit the single process. ZeRO-1 sums the gradient norm's squares shard by
    shard (its last bit can differ, and so every clipped update by an ulp here and there: seen with oneDNN's
    AVX-512 kernels), so its norms are held to fp32 rounding; with TP or PP the bf16 arithmetic rounds in other
    places (partial sums, stage boundaries), and Adam's first steps turn a tiny gradient difference of a
    near-zero element into up to 2·lr: compared as the distance from the single process's weights relative to
    how far those moved, per parameter and for the whole model."""
    ref, results = single(), launched()[str(case)]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
        assert r["n_params"] == r["analytic_params"]
        if case.tp == case.pp == 1:
            torch.testing.assert_close(torch.tensor(r["norms"][0]), torch.tensor(ref["norms"][0]), rtol=1e-6, atol=0)
    merged = _merged(results)
    assert sorted(merged) == sorted(ref["state"])
    off, moved = 0.0, 0.0
    for name, w in ref["state"].items():
        assert merged[name].dtype == torch.bfloat16 and w.dtype == torch.bfloat16, name
        n = VOCAB if name in VOCAB_ROWS else None
        mine, w, start = merged[name][:n].float(), w[:n].float(), initial()[name].float()
        if case.tp == case.pp == 1 and not case.zero:
            assert torch.equal(mine, w), name
        assert (mine - w).norm() < UPDATE_TOL[0] * (w - start).norm(), name
        off, moved = off + float((mine - w).norm() ** 2), moved + float((w - start).norm() ** 2)
    assert off < UPDATE_TOL[1] ** 2 * moved, (off / moved) ** 0.5


def test_bf16_params_halve_the_pipelines_bytes_and_keep_dp_sync_in_fp32() -> None:
    """tp2 pp2: every pipeline transfer is bf16 (the formula at 2 bytes, and half the fp32 run's counted bytes;
    the norm's fp32 scalar over PP stays); the DP traffic (gradients, fp32 main-grad buckets) is the fp32 run's."""
    low, full = launched()[str(CASES[2])], launched()[str(CASES[-1])]
    case = CASES[2]
    for r in low:
        want = pp_bytes_per_step(MICRO, SEQ, make_cfg(case, WORLD).model.hidden, case.tp, case.sp,
                                 r["microbatches"], case.pp, case.v, r["coord"][0], itemsize=2)
        assert all({op: b for (g, op), b in step.items() if g == "pp"} == want for step in r["bytes"]), r["coord"]
    for a, b in zip(low, full):
        for step_a, step_b in zip(a["bytes"], b["bytes"]):
            pp_a = {k: v for k, v in step_a.items() if k[0] == "pp" and k[1].startswith(("send", "recv"))}
            pp_b = {k: v for k, v in step_b.items() if k[0] == "pp" and k[1].startswith(("send", "recv"))}
            assert pp_a and {k: 2 * v for k, v in pp_a.items()} == pp_b, (a["coord"], pp_a, pp_b)
            dp = lambda s: {k: v for k, v in s.items() if k[0] == "dp"}  # noqa: E731
            assert dp(step_a) == dp(step_b)


def test_tp_bytes_are_the_formulas_at_bf16_activations_and_residual_stream() -> None:
    """tp2 with sequence parallelism: the layers' exchanges and the embedding's are bf16 (unlike autocast,
    whose residual stream stays fp32); the cross-entropy's, the replicated gradients' and the norm's stay fp32."""
    case = CASES[3]
    cfg = make_cfg(case, WORLD)
    for r in launched()[str(case)]:
        want = tp_bytes_per_step(cfg.model, MICRO, SEQ, case.tp, case.sp, r["microbatches"], itemsize=2, residual=2)
        for step in r["bytes"]:
            assert {op: b for (g, op), b in step.items() if g == "tp"} == want, (r["coord"], step, want)


def test_zero1_all_gathers_bf16_parameters() -> None:
    """ZeRO-1 under bf16 parameters: the reduce-scatter moves the fp32 main gradients (4 bytes per padded
    element), the all-gather the bf16 parameters (2 bytes), and the norm one fp32 scalar."""
    for r in launched()[str(CASES[1])]:
        padded = sum(p for _, p in r["bucket_numel"])
        want = {("dp", "reduce_scatter"): 4 * padded, ("dp", "all_gather"): 2 * padded, ("dp", "all_reduce"): 4}
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (r["coord"], step)


def test_zero2_reduce_scatters_fp32_main_gradients_every_microbatch_and_gathers_bf16() -> None:
    """ZeRO-2 under bf16 parameters: each microbatch's bf16 gradients are added into an fp32 round, reduce-scattered
    (4 bytes per padded element and microbatch) into fp32 shards; the all-gather moves bf16 parameters."""
    for r in launched()[str(ZERO2_LOW)]:
        padded, m = sum(p for _, p in r["bucket_numel"]), r["microbatches"]
        want = {("dp", "reduce_scatter"): 4 * m * padded, ("dp", "all_gather"): 2 * padded, ("dp", "all_reduce"): 4}
        assert m == 2 and r["grad_bytes"] == 4 * padded // 2 and r["grads_none"]
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (r["coord"], step)


def test_zero3_keeps_bf16_shards_and_gathers_bf16_blocks() -> None:
    """ZeRO-3 under bf16 parameters: each rank keeps its bf16 parameter shard (2 bytes per padded element / dp)
    beside its fp32 main weights; the all-gathers move bf16 (2 bytes: each block twice, the root once, per
    microbatch), the reduce-scatters fp32 main gradients."""
    for r in launched()[str(ZERO3_LOW)]:
        padded, m = sum(p for _, p in r["bucket_numel"]), r["microbatches"]
        gathered = sum(n * (1 if root else 2) for root, n in r["zero3"]["units"])
        want = {("dp", "reduce_scatter"): 4 * m * padded, ("dp", "all_gather"): 2 * m * gathered,
                ("dp", "all_reduce"): 4}
        assert r["zero3"]["kept"] == 2 * padded // 2 and r["zero3"]["gathered"] == 0
        for step in r["bytes"]:
            assert {k: b for k, b in step.items() if k[0] == "dp"} == want, (r["coord"], step)


def test_zero1_moments_are_the_plain_mixed_optimizers_split_over_dp() -> None:
    plain, zero = launched()[str(CASES[0])], launched()[str(CASES[1])]
    assert sum(r["moments"][0] for r in zero) == plain[0]["moments"][0]
    for a, b in zip(plain, zero):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), **LOSS_TOL)


def test_checkpoint_holds_fp32_main_weights_and_resumes(tmp_path: Path) -> None:
    resharded = [Case(tp=2, zero=1), Case(tp=2)]
    torch.set_num_threads(1)
    resume_cfgs(WORLD, tmp_path, Case(zero=1), resharded, (*BF16, *L2))
    results = run_frozen(resume_runs, WORLD, tmp_path, Case(zero=1), resharded, (*BF16, *L2), timeout=TIMEOUT)
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        assert all(torch.equal(r["same_final"][name], w) for name, w in r["final"].items())
    saved = _saved(results)  # the bf16 weights the run held at the save
    for case in map(str, resharded):
        loaded: dict[str, torch.Tensor] = {}
        for r in results:
            loaded.update(r[case]["loaded"] or {})
        loaded.pop("head.weight", None)
        assert all(torch.equal(loaded[name], w) for name, w in saved.items()), case
        for r in results:
            torch.testing.assert_close(torch.tensor(r[case]["losses"]), torch.tensor(r["base"]["losses"][SAVE_AT:]),
                                       **LOSS_TOL)
    path = step_path(tmp_path / "base", SAVE_AT)
    fp32 = _resume(_cfg(Case(), 1, tmp_path, "fp32", *L2, "checkpoint.allow_changes=true"), ParallelContext.single(),
                   path)
    weights = _weights(fp32)
    cfg = _cfg(Case(), 1, tmp_path, "files", *L2)
    model = build_chunks(cfg, VOCAB, ParallelContext.single())
    load_weights(model, path)
    files = {n: t[:VOCAB] if n in VOCAB_ROWS else t for n, t in model[0].state_dict().items()}
    for name, w in saved.items():
        main = files[name]
        assert main.dtype == torch.float32 and torch.equal(weights[name], main), name
        assert torch.equal(main.bfloat16(), w), f"{name}: the bf16 weight is not the main weight rounded"
    assert any(not torch.equal(t.bfloat16().float(), t) for t in files.values()), "the files hold only bf16 values"
    assert len(_train(fp32)) == STEPS - SAVE_AT


def test_main_grads_accumulate_the_microbatches_in_fp32() -> None:
    """64 microbatches' bf16 gradients of a bf16 layer land in GradSync's fp32 `main_grad`: their sum within
    fp32 round-off of the float64 sum; summed in bf16 (what a bf16 `.grad` would do) they miss it by far more,
    so the test tells the two apart."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
    sync = GradSync(list(layer.parameters()), None, hook=None, state=None, main_grads=True)
    xs = [torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(64)]
    each = [torch.autograd.grad(layer(x).float().square().mean(), layer.weight)[0] for x in xs]
    sync.begin_step(len(xs))
    for x in xs:
        layer(x).float().square().mean().backward()
    exact = torch.stack([g.double() for g in each]).sum(0)
    in_bf16 = torch.zeros_like(each[0])
    for g in each:
        in_bf16 += g
    scale = float(exact.abs().max())
    assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
    assert float((layer.weight.main_grad.double() - exact).abs().max()) < 1e-6 * scale
    assert float((in_bf16.double() - exact).abs().max()) > 1e-3 * scale


def _losses(*extra: str) -> list[float]:
    torch.set_num_threads(1)
    case = Case(extra=(f"train.steps={TRACK_STEPS}", "model.n_layers=2", "optim.grad_clip=1.0", *extra))
    return train_case(ParallelContext.single(), case, 1)["losses"]


def test_bf16_params_track_fp32_training() -> None:
    """The same TRACK_STEPS steps in fp32 and with bf16 parameters (fp32 main weights): every step's loss within
    TRACK_TOL of fp32's, relative, and as close as bf16 autocast's (fp32 weights) within a factor of 2."""
    fp32, low, autocast = _losses(), _losses(*BF16), _losses("train.precision=bf16")
    gap = lambda losses: max(abs(a - b) / b for a, b in zip(losses, fp32))  # noqa: E731
    assert fp32[-1] < 0.9 * fp32[0], fp32  # it learns
    assert 0 < gap(low) < TRACK_TOL, (gap(low), low, fp32)
    assert gap(low) < 2 * gap(autocast) + 1e-3, (gap(low), gap(autocast))
