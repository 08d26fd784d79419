"""`plan.calibrate.fitted` against a block of known cost: a module whose forward sleeps what the cost model's work
at a known rate factor plus a known fixed cost an op would take (injected delays of tens of milliseconds, far beyond
a sleep's overshoot), from which the fit must recover both; `plan.probe` on two gloo ranks."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hybrid.plan import probe
from hybrid.plan.calibrate import fitted, model_pass_s
from hybrid.plan.cost import KERNELS, Shape
from hybrid.plan.hardware import Device, Link

SHAPE_KW = {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 512, "swiglu": False}
DEV = Device("cpu", 4e9, 2**30, 4e10, gemm=1.0, attention=0.5, launch_s=1e-6, kind="cpu")
SCALE, FIXED = 1.5, 300e-6  # the block runs 1.5× the model's work, plus 300 µs an op


class Sleeper(nn.Module):
    """Hidden states in and out; its forward takes what the cost model says at SCALE plus FIXED an op."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape, self.w = shape, nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = model_pass_s(self.shape, x.shape[1], DEV) - 3 * KERNELS * DEV.launch_s
        time.sleep(SCALE * work + 3 * KERNELS * FIXED)
        return x * self.w.sum()


def test_the_fit_separates_a_blocks_rate_from_its_fixed_cost_an_op() -> None:
    shape = Shape(**SHAPE_KW)
    got = fitted(DEV, shape, 256, lambda: Sleeper(shape))
    assert got.peak == pytest.approx(DEV.peak / SCALE, rel=0.15)
    assert got.launch_s == pytest.approx(FIXED, rel=0.25)
    assert got.optimizer_bw > 0


def test_the_link_probe_reports_the_hop_under_load_as_the_links_latency() -> None:
    """Two gloo ranks forked here: a positive bus bandwidth, and the link's latency the larger of the idle and the
    loaded hop (no claim on the figures themselves: they are this machine's)."""
    got = probe.measure(2, 64, 64, timeout=120)
    assert got["busbw"] > 0 and got["idle_latency"] > 0
    assert got["latency"] == max(got["idle_latency"], got["loaded_latency"])
    assert probe.link_of(got) == Link(got["busbw"], got["latency"])
