"""Single-process checks of the gradient seams: GradSync's metering and metrics, the optimizer's step."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybrid.config import OptimConfig
from hybrid.optim import ModelOptimizer, adamw, build_optimizer, clip_grads, global_grad_norm
from hybrid.parallel.dp import data
from hybrid.parallel.dp.data import GradSync, MeteredState, SyncReport, finalize_grads
from hybrid.parallel.params import ParamInfo

OPTIM = OptimConfig(weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=0.05)
CTX = SimpleNamespace(tp_rank=0, tp_group=None, pp_group=None, embedding_group=None)  # one rank: no collective


class Meter:
    """A hook state with the metered interface, and what it was asked."""

    def __init__(self) -> None:
        self.measure = False

    def take_error(self) -> tuple[float, float]:
        return 0.5, 2.0


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    for p in m.parameters():
        p.hybrid = ParamInfo()  # replicated over TP, as a plain parameter is
    return m


def backward(m: nn.Module) -> None:
    m(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()


@pytest.mark.parametrize("report,on,expected", [
    (SyncReport(error=True), True, True),
    (SyncReport(error=True), False, False),
    (SyncReport(error=False), True, False),
    (SyncReport(error=True, exact=True), True, False),
])
def test_meter_sets_measure_only_when_the_error_is_reported(report: SyncReport, on: bool, expected: bool) -> None:
    state = Meter()
    assert isinstance(state, MeteredState)
    sync = GradSync(list(model().parameters()), None, lambda s, b: None, state, report=report)
    sync.meter(on)
    assert state.measure is expected


def test_meter_leaves_a_plain_state_alone() -> None:
    state = SimpleNamespace()
    assert not isinstance(state, MeteredState)
    GradSync(list(model().parameters()), None, lambda s, b: None, state, report=SyncReport(error=True)).meter(True)
    assert not hasattr(state, "measure")


def test_metrics_keys_follow_the_report_and_the_dp_size() -> None:
    sync = GradSync(list(model().parameters()), None, lambda s, b: None, Meter(), report=SyncReport(error=True))
    figures = sync.local_metrics()
    assert figures[-3:-1] == [0.5, 2.0] and figures[3] == 0.0  # the meter's sums; no ring at dp=1
    assert sync.metrics([8.0, 4.0, 2.0, 6.0, 1.0, 4.0, 0.0], 2) == {"bytes_dp": 4.0}  # dp=1: no compression figures
    hier = GradSync(list(model().parameters()), None, lambda s, b: None, None, report=SyncReport(inter_node=True))
    assert hier.metrics([8.0, 4.0, 2.0, 6.0, 1.0, 4.0, 0.0], 2) == {"bytes_dp": 4.0, "bytes_dp_inter": 2.0}


def test_a_step_that_sends_nothing_has_no_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp > 1: the ratio is the exact ring bytes over those sent; a step (or logging window) that sent nothing, as
    0/1 Adam's local steps, reports no ratio rather than a made-up one."""
    monkeypatch.setattr(data.C, "size", lambda group: 2)
    sync = GradSync(list(model().parameters()), None, lambda s, b: None, None, report=SyncReport())
    assert sync.metrics([8.0, 0.0, 2.0, 6.0, 0.0, 0.0, 0.0], 2)["compression_ratio"] == 3.0
    assert sync.metrics([0.0, 0.0, 0.0, 6.0, 0.0, 0.0, 0.0], 2) == {"bytes_dp": 0.0}


def test_optimizer_step_is_norm_clip_adamw_in_bucket_order() -> None:
    """`step(lr)` does what the trainer did before it: LR into the groups, the global norm over the
    GradSync's parameters, clipping, AdamW; the same floats."""
    ours, ref = model(), model()
    sync = GradSync(list(ours.parameters()), None, lambda s, b: None, None, bucket_mb=1e-4)
    optimizer = build_optimizer(ours, OPTIM, 1e-3, CTX, sync)
    ref_optimizer = adamw(ref, OPTIM, 1e-3)
    ref_params = [dict(ref.named_parameters())[n] for n in _names_in(ours, sync.parameters())]
    for _ in range(3):
        backward(ours)
        backward(ref)
        finalize_grads(sync, CTX.embedding_group, CTX.tp_group)
        norm = optimizer.step(2e-3)
        sync.zero_grad()
        for group in ref_optimizer.param_groups:
            group["lr"] = 2e-3
        ref_norm = global_grad_norm(ref_params, CTX)
        clip_grads(ref_params, OPTIM.grad_clip, ref_norm)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        assert torch.equal(norm, ref_norm)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert isinstance(optimizer, ModelOptimizer)
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    assert all(g["lr"] == 2e-3 for g in optimizer.param_groups)
    p = next(ours.parameters())
    assert optimizer.state[p] is optimizer.optimizer.state[p]
    restored = ModelOptimizer(adamw(ours, OPTIM, 1e-3), sync.parameters(), CTX, OPTIM.grad_clip)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert torch.equal(restored.state[p]["exp_avg"], optimizer.state[p]["exp_avg"])


def _names_in(m: nn.Module, params: list[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in m.named_parameters()}
    return [names[id(p)] for p in params]


def test_sum_of_squares_is_as_accurate_as_a_full_size_square() -> None:
    """The row-blocked Σg² (no full-size temporary) against fp64, on lengths with and without a tail."""
    from hybrid.optim.adamw import sum_of_squares

    for n in (7, 1024, 3 * 2**20 + 5):
        g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
        exact = g.double().pow(2).sum()
        for shaped in (g, g.view(-1, 1)):
            assert abs(float(sum_of_squares(shaped)) - float(exact)) <= 1e-6 * float(exact)


def test_the_multi_tensor_squares_equal_the_per_tensor_ones_to_fp32_rounding() -> None:
    """CUDA's path (`torch._foreach_norm` over every gradient, a few launches) run here on the CPU against the
    per-tensor path the CPU takes (a fused op replacing unfused ones: equal within fp32 rounding, 1e-6 relative);
    no gradient is 0 on either path."""
    from hybrid.optim.adamw import total_squares

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * s for n, s in ((7, 1.0), (4096, 1e-3), (33, 10.0), (1, 0.5))]
    cpu = torch.device("cpu")
    one, each = total_squares(grads, cpu, foreach=True), total_squares(grads, cpu)
    assert torch.allclose(one, each, rtol=1e-6, atol=0) and one.dtype == torch.float32
    assert float(total_squares([], cpu, foreach=True)) == 0.0 == float(total_squares([], cpu))


def test_fused_and_foreach_adamw_take_the_same_step() -> None:
    """`optim.implementation`: the kernels differ, the update does not (fp32 rounding aside)."""
    results = []
    for implementation in ("fused", "foreach"):
        m = model()
        opt = adamw(m, OptimConfig(implementation=implementation), 1e-3)
        for _ in range(3):
            backward(m)
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
