"""What a resume refuses and when a run has nothing to do (`refuse_changes`, `finished_line`).

The manifests are built as the Checkpointer writes them (the resolved config, the step); what a
refusal must name is the difference of the two configs computed here, independently.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from hybrid.checkpoint import CheckpointError, finished_line, refuse_changes
from hybrid.config import compose_config

PATH = Path("ck/run/step_0000010")
BASE = ["train.steps=10"]
SAVED = compose_config(BASE)


def manifest(step: int = 10) -> dict[str, Any]:
    """A checkpoint's manifest (the parts read here) of the run composed from BASE, at `step`."""
    return {"step": step, "config": OmegaConf.to_container(SAVED, resolve=True)}


def leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def differing(saved: dict[str, Any], cfg: Any) -> set[str]:
    """The keys whose resolved values differ between the saved config and `cfg`."""
    a, b = leaves(saved), leaves(OmegaConf.to_container(cfg, resolve=True))
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


TRAINING = [["train.lr=1e-3"], ["train.seed=7"], ["train.global_batch_size=64"], ["train.micro_batch_size=4"],
            ["train.precision=fp32"], ["optim.weight_decay=0"], ["optim.warmup_steps=3"], ["model.dropout=0.1"],
            ["data.max_chars=1000"], ["data.seq_len=64"], ["compression=powersgd"], ["train.lr=1e-3", "train.seed=3"]]
FREE = [["parallel=tp2pp2"], ["parallel.bucket_mb=1", "parallel.schedule=gpipe"], ["checkpoint.every=5"],
        ["checkpoint.keep=1", "checkpoint.resume=auto"], ["logging.log_every=3", "logging.wandb.mode=disabled"],
        ["profile.steps=[1,2]"], ["run_name=other"], ["train.device=cpu"], ["train.eval_every=5"],
        ["train.eval_batches=1"], ["train.steps=200"], ["data.cache_dir=/tmp/c"], ["compression.measure_error=false"]]


@pytest.mark.parametrize("overrides", TRAINING, ids=" ".join)
def test_a_changed_training_setting_is_refused_naming_every_difference(overrides: list[str]) -> None:
    saved, cfg = manifest(), compose_config([*BASE, *overrides])
    diff = differing(saved["config"], cfg)
    assert diff
    with pytest.raises(CheckpointError) as e:
        refuse_changes(saved, cfg, PATH)
    message = str(e.value)
    assert "\n" not in message and str(PATH) in message and "checkpoint.allow_changes=true" in message
    assert set(re.findall(r"([\w.]+): \S+ → ", message)) == diff


@pytest.mark.parametrize("overrides", TRAINING[:3], ids=" ".join)
def test_allow_changes_accepts_them(overrides: list[str]) -> None:
    refuse_changes(manifest(), compose_config([*BASE, *overrides, "checkpoint.allow_changes=true"]), PATH)


@pytest.mark.parametrize("overrides", FREE, ids=" ".join)
def test_layout_files_logging_length_and_evals_may_change(overrides: list[str]) -> None:
    saved, cfg = manifest(), compose_config([*BASE, *overrides])
    assert differing(saved["config"], cfg)  # they do differ, and are still not refused
    refuse_changes(saved, cfg, PATH)


OLDER_DEFAULTS = [("fraction", 0.01, None, {"topk", "dgc"}), ("dgc_momentum", 0.9, 0.0, {"dgc"}),
                  ("block_layout", "rows", "auto", {"int8", "int4", "sign", "onebit_adam", "zeroone_adam"}),
                  ("scale", "none", "auto", {"int8", "int4", "sign"})]
"""(compression knob, another value in a run's saved config, today's default, the methods that read it)."""


@pytest.mark.parametrize("knob,old,new,readers", OLDER_DEFAULTS, ids=[k[0] for k in OLDER_DEFAULTS])
@pytest.mark.parametrize("method", ["none", "powersgd", "topk", "dgc", "sign"])
def test_an_older_checkpoints_method_knob_counts_only_where_a_method_reads_it(
        knob: str, old: object, new: object, readers: set[str], method: str) -> None:
    """Older hybrids saved compression.fraction=0.01 and dgc_momentum=0.9 in every config; today's defaults are
    null (sized from the run) and 0: the old value stops a resume only where the method reads the knob."""
    saved = {"step": 10, "config": OmegaConf.to_container(compose_config([*BASE, f"compression={method}"]),
                                                           resolve=True)}
    saved["config"]["compression"][knob] = old
    cfg = compose_config([*BASE, f"compression={method}"])
    if method in readers:
        with pytest.raises(CheckpointError, match=rf"compression.{knob}: {old} → {new}"):
            refuse_changes(saved, cfg, PATH)
    else:
        refuse_changes(saved, cfg, PATH)
    refuse_changes(saved, compose_config([*BASE, f"compression={method}", f"compression.{knob}={old}"]), PATH)


def test_a_key_the_saved_config_lacks_is_no_change() -> None:
    """A checkpoint of an older hybrid has no value for a newer key: it ran as that key's default."""
    saved = manifest()
    del saved["config"]["optim"]["grad_clip"]
    refuse_changes(saved, compose_config([*BASE, "optim.grad_clip=0.5"]), PATH)


def test_powersgd_from_before_the_factor_dtype_ran_fp32_factors() -> None:
    """A checkpoint whose config lacks `compression.factor_dtype` sent PowerSGD's factors in fp32: resuming it under
    today's default (bf16) is a training change; fp32 is none, nor is any default for a method that does not read
    it."""
    saved = manifest()
    saved["config"]["compression"]["method"] = "powersgd"
    del saved["config"]["compression"]["factor_dtype"]
    with pytest.raises(CheckpointError, match=r"compression.factor_dtype: fp32 → bf16"):
        refuse_changes(saved, compose_config([*BASE, "compression=powersgd"]), PATH)
    refuse_changes(saved, compose_config([*BASE, "compression=powersgd", "compression.factor_dtype=fp32"]), PATH)
    saved["config"]["compression"]["method"] = "sign"
    refuse_changes(saved, compose_config([*BASE, "compression=sign"]), PATH)


@pytest.mark.parametrize("saved_step, steps", [(10, 10), (12, 10), (9, 10), (10, 11)])
def test_a_checkpoint_at_train_steps_has_nothing_to_do(saved_step: int, steps: int) -> None:
    line = finished_line(PATH, manifest(saved_step), compose_config([f"train.steps={steps}"]))
    if saved_step < steps:
        assert line is None
        return
    assert line is not None and "\n" not in line
    assert line.startswith(f"nothing to do: {PATH} is at step {saved_step} ")
    assert "raise train.steps" in line and "checkpoint.resume=none" in line
