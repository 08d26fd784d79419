"""The benchmarks run end to end at tiny sizes (no timing assertions: only that they work and agree)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hybrid.bench import health_cost, memory_at_scale, model_size, precision, recompute, step_vs_hf, timing_overhead

TINY = ["--model", "gpt-tiny", "--steps", "1", "--warmup", "1", "--threads", "1", "--seq-len", "16",
        "--micro-batch", "2", "--microbatches", "2", "--repeats", "2"]


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_step_vs_hf_runs_and_both_sides_agree(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `main` (exit status 0), its result recorded."""
    results, real_run = [], step_vs_hf.run

    def recorded(args: argparse.Namespace) -> dict[str, Any]:
        results.append(real_run(args))
        return results[-1]

    monkeypatch.setattr(step_vs_hf, "run", recorded)
    assert step_vs_hf.main(TINY) == 0
    (result,) = results
    out = capsys.readouterr().out
    for needle in ("hybrid/ref", "attn_implementation='sdpa'", "match: True", "reproduce: OMP_NUM_THREADS=1"):
        assert needle in out
    (row,) = result["rows"]
    assert row.threads == 1 and row.hybrid > 0 and row.reference > 0 and len(row.round_ratios) == 2
    h, r = result["hybrid_losses"], result["reference_losses"]
    assert len(h) == len(r) == 4  # 2 rounds × (1 warmup + 1 timed) steps per side
    assert h[0] == pytest.approx(r[0], abs=1e-5)  # same weights, same first batch
    assert h[-1] == pytest.approx(r[-1], abs=1e-3)  # same optimizer and data: the runs track each other


def test_step_vs_hf_main_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert step_vs_hf.main([*TINY, "--seq-len", "4096"]) == 2  # beyond gpt-tiny's learned positions
    assert "max_seq_len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_vs_hf.parse_args(["--model", "no-such-model"])


def test_model_size_counts_match_the_formula(capsys: pytest.CaptureFixture[str]) -> None:
    rows = model_size.run(model_size.model_names(), seq_len=None)
    assert {r["model"] for r in rows} >= {"gpt-tiny", "gpt-125m", "gpt-1b", "llama-1b"}
    assert all(r["match"] for r in rows)
    gpt1b = next(r for r in rows if r["model"] == "gpt-1b")
    assert gpt1b["flops_per_token"] == 6 * gpt1b["params"] + 12 * 16 * 2048 * 2048
    assert model_size.main(["--models", "gpt-tiny", "--seq-len", "128"]) == 0
    assert "gpt-tiny" in capsys.readouterr().out


def test_timing_overhead_runs_both_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert timing_overhead.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "median paired ratio on/off" in out and "| unattributed |" in out


def test_health_cost_times_both_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert health_cost.main(["--quick"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpt-tiny"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3].endswith(" ms") and cells[4].endswith(" ms") and float(cells[4][:-3]) > 0


def test_recompute_runs_every_mode_and_its_memory_matches_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    assert recompute.main(["--quick"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| gpt-tiny")]
    assert [r[1] for r in rows] == ["none", "selective", "full"]
    assert all(r[-2] == r[-1] for r in rows), rows  # the saved-tensor tally equals hybrid.memory's estimate
    kept = [float(r[-2].replace(",", "")) for r in rows]
    assert kept[2] < kept[1] < kept[0]


def test_precision_bench_trains_the_same_model_in_each_precision() -> None:
    """Same weights and data: every precision's last loss is fp32's within bf16's rounding (2 %), and the first
    precision is the ratios' yardstick."""
    args = precision.parse_args(["--seq-len", "4", "--rounds", "2"])  # bf16 on a CPU is slow: 4 tokens
    rows = precision.run(args)
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "bf16_params"] and rows[0]["ratio"] == 1.0
    assert all(r["step_s"] > 0 and abs(r["loss"] - rows[0]["loss"]) < 2e-2 * rows[0]["loss"] for r in rows)


def test_memory_at_scale_reads_its_run_specs_and_never_launches_what_the_estimate_says_will_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec becomes the layout, ZeRO and recomputation it names (dp = 8 / (tp·pp)); with MemAvailable too
    small for the estimate plus the margin, the run is skipped before any rank is forked."""
    from hybrid.config import compose_config

    args = memory_at_scale.parse_args(["--seq-len", "32"])
    cfg = compose_config(memory_at_scale.overrides("gpt-tiny tp1pp2 full zero", args))
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.zero, cfg.train.recompute, cfg.data.seq_len) == (1, 2, 4, 1, "full", 32)
    total, stages = memory_at_scale.machine_estimate(cfg)
    assert len(stages) == 2 and total == sum(stages) * 4
    monkeypatch.setattr(memory_at_scale, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(memory_at_scale, "proc_status_kb", lambda *_: (total + 2**30) // 1024)
    assert "skipped" in memory_at_scale.measure("gpt-tiny tp1pp2 full zero", args)
