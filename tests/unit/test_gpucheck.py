"""The GPU check's dry run on CPU (so its code paths cannot rot), its figures against their references, and its
one-line refusal without a GPU."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from hybrid.bench import gpucheck, gpucheck_steps
from hybrid.bench.gpucheck_steps import Setting
from hybrid.record.metrics import model_flops_per_token


def test_dry_run_measures_every_part_and_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    monkeypatch.setattr(gpucheck_steps, "peak_flops", lambda _device: 1e12)  # a made-up peak: MFU's formula
    out = tmp_path / "check.json"
    assert gpucheck.main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["cuda_vs_cpu"]["ok"] and "vs transformers loop, gpt-tiny" in printed
    plan = gpucheck.plan_for(gpucheck.parse_args(["--dry-run"]))
    (run,) = result["runs"]
    assert run["setting"] == str(plan.settings[0]) and len(run["losses"]) == plan.warmup + plan.steps
    tokens = plan.steps * 2 * run["micro_batch"] * plan.seq_len
    assert run["tokens_per_s"] == pytest.approx(tokens / (run["step_s"] * plan.steps))
    cfg = gpucheck_steps.config("gpt-tiny", plan.settings[0], plan.device, plan.seq_len, run["micro_batch"], 1)
    assert run["estimate_bytes"] == gpucheck_steps.estimate(cfg, plan.device)
    model = gpucheck_steps.trainer(cfg, plan.device)
    flops = model_flops_per_token(model.n_params, cfg.model.n_layers, cfg.model.hidden, plan.seq_len)
    assert run["mfu"] == pytest.approx(run["tokens_per_s"] * flops / 1e12)
    assert run["sdpa"] in {label for _, label in gpucheck_steps.SDPA_OPS} and run["peak_bytes"] is None
    (ref,) = result["vs_reference"]
    assert ref["ratio"] == statistics.median(ref["round_ratios"]) and len(ref["round_ratios"]) == plan.rounds


def test_the_sdpa_backend_is_read_from_the_ops_that_ran() -> None:
    """Dropout 0 on CPU runs the fused kernel; a math-only context makes the same forward report math."""
    cfg = gpucheck_steps.config("gpt-tiny", Setting("fp32", False), torch.device("cpu"), 16, 1, 1)
    trainer = gpucheck_steps.trainer(cfg, torch.device("cpu"))
    assert gpucheck_steps.sdpa_backend(trainer) == "flash (cpu)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        assert gpucheck_steps.sdpa_backend(trainer) == "math"


def test_without_a_gpu_it_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpucheck.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid: error: no CUDA device here")


def test_settings_parse_and_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert Setting.parse("bf16_params+compile") == Setting("bf16_params", True)
    assert Setting.parse("fp32") == Setting("fp32", False)
    for bad in (["--settings", "bf16+cuda-graphs"], ["--settings", "fp16"], ["--models", "gpt-nope"]):
        assert gpucheck.main(["--dry-run", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hybrid: error: {bad[0]}: "), err


def test_the_transformers_reference_runs_beside_gpt_models_only() -> None:
    plan = gpucheck.plan_for(gpucheck.parse_args(["--dry-run", "--models", "llama-tiny", "gpt-tiny"]))
    assert plan.references == ("gpt-tiny",)
    plan = gpucheck.plan_for(gpucheck.parse_args(["--dry-run", "--models", "gpt-tiny", "--no-reference"]))
    assert plan.references == () and plan.settings == (Setting("bf16_params", False),)


def test_timed_steps_read_the_device_only_on_the_steps_fit_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """log_every 3 over 7 steps: steps 3 and 6 and the last are due, as `Trainer.fit` runs them."""
    cfg = gpucheck_steps.config("gpt-tiny", Setting("fp32", False), torch.device("cpu"), 8, 1, 7,
                                ["logging.log_every=3"])
    trainer = gpucheck_steps.trainer(cfg, torch.device("cpu"))
    dues: list[bool] = []
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda due: dues.append(due) or step(due=due))
    losses = [gpucheck_steps.user_step(trainer) for _ in range(7)]
    assert dues == [False, False, True, False, False, True, True]
    assert all(isinstance(x, torch.Tensor) for x in losses)
