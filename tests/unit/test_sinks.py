"""hybrid.record.sinks: grouped metric names, the wandb settings' precedence, wandb's folders and run id (a fake
wandb module records what wandb.init and run.log get), and TensorBoard read back against metrics.jsonl."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hybrid.config import WandbConfig
from hybrid.record.metrics import grouped, metric_name
from hybrid.record.sinks import TENSORBOARD_MISSING, MetricsLogger, TensorBoardSink
from hybrid.record.wandb_run import WANDB_DIRS, WandbSettings

WANDB_VARS = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_DIR", *WANDB_DIRS)


def test_grouped_names() -> None:
    """Train values under train/, throughput under perf/, bytes under traffic/, eval under eval/; a name
    that already has a group keeps it; step and nulls are left out."""
    assert {k: metric_name(k) for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s",
                                        "bytes_dp", "eval_loss", "comm/dp/all_reduce_ms", "time/data")} == {
        "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
        "mfu": "perf/mfu", "step_time_s": "perf/step_time_s", "bytes_dp": "traffic/bytes_dp",
        "eval_loss": "eval/loss", "comm/dp/all_reduce_ms": "comm/dp/all_reduce_ms", "time/data": "time/data"}
    assert grouped({"step": 3, "loss": 2.0, "grad_norm": None, "ok": True}) == {"train/loss": 2.0}


def test_config_values_left_at_defaults_yield_to_the_env() -> None:
    """WANDB_MODE/PROJECT/ENTITY/RUN_GROUP fill the values the config left at WandbConfig's defaults;
    a value set in the config wins; wandb's old mode names are understood."""
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e", "WANDB_RUN_GROUP": "g"}
    assert WandbSettings.of(WandbConfig(), env) == WandbSettings("disabled", "p", "e", "g", ())
    mine = WandbConfig(mode="online", project="mine", group="sweep", tags=["a"])
    assert WandbSettings.of(mine, env) == WandbSettings("online", "mine", "e", "sweep", ("a",))
    assert WandbSettings.of(WandbConfig(), {"WANDB_MODE": "dryrun"}).mode == "offline"
    assert WandbSettings.of(WandbConfig(), {}) == WandbSettings()  # the dataclasses agree on the defaults


class FakeRun:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls.append(("log", (step, values)))

    def finish(self, exit_code: int = 0) -> None:
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """A `wandb` module recording init's kwargs, the env it saw, and the run's log/finish calls."""
    calls: list[tuple[str, Any]] = []
    for var in WANDB_VARS:
        monkeypatch.delenv(var, raising=False)

    def init(**kwargs: Any) -> FakeRun:
        calls.append(("init", {**kwargs, "env": {v: os.environ.get(v) for v in WANDB_VARS}}))
        return FakeRun(calls)

    fake = types.SimpleNamespace(init=init, Settings=lambda **kw: kw, login=lambda **kw: True)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


def _inits(calls: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [kw for kind, kw in calls if kind == "init"]


def test_wandb_run_continues_and_gets_grouped_names(tmp_path: Path, fake_wandb: list[tuple[str, Any]]) -> None:
    """A continued run (start_step > 0) passes the id kept in wandb/run_id with resume="allow"; a fresh
    start gets a new id; the folders default under <run dir>/wandb and the env is as before at close."""
    run = tmp_path / "run"
    before = dict(os.environ)
    with MetricsLogger(str(run), {"a": 1}, True, 4, progress=False, run_name="r", wandb_group="g",
                       wandb_tags=["x", "y"]) as m:
        m.log(1, {"loss": 2.0, "tokens_per_s": 10.0, "comm/dp/ms": 1.5})
        m.log_eval(1, 1.5)
    with MetricsLogger(str(run), {}, True, 4, progress=False, start_step=1) as m:
        m.log(2, {"loss": 1.0})
    with MetricsLogger(str(run), {}, True, 4, progress=False) as m:
        pass
    first, resumed, fresh = _inits(fake_wandb)
    kept = (run / "wandb" / "run_id").read_text().strip()
    assert first["id"] != fresh["id"] == kept and resumed["id"] == first["id"]
    assert all(kw["resume"] == "allow" and kw["dir"] == str(run) for kw in (first, resumed, fresh))
    assert first["group"] == "g" and first["tags"] == ["x", "y"] and first["name"] == "r"
    assert first["env"]["WANDB_CACHE_DIR"] == str(run / "wandb" / "cache")
    assert all((run / "wandb" / sub).is_dir() for sub in WANDB_DIRS.values())
    logs = [args for kind, args in fake_wandb if kind == "log"]
    assert logs == [(1, {"train/loss": 2.0, "perf/tokens_per_s": 10.0, "comm/dp/ms": 1.5}), (1, {"eval/loss": 1.5}),
                    (2, {"train/loss": 1.0})]
    assert dict(os.environ) == before


def test_the_users_wandb_folders_are_kept(tmp_path: Path, fake_wandb: list[tuple[str, Any]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_DIR and WANDB_CACHE_DIR set by the user are neither overwritten nor removed."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    with MetricsLogger(str(tmp_path / "run"), {}, True, 2, progress=False):
        pass
    (kw,) = _inits(fake_wandb)
    assert kw["dir"] is None and kw["env"]["WANDB_DIR"] == str(tmp_path / "mine")
    assert kw["env"]["WANDB_CACHE_DIR"] == str(tmp_path / "cache")
    assert kw["env"]["WANDB_DATA_DIR"] == str(tmp_path / "run" / "wandb" / "data")
    assert os.environ["WANDB_CACHE_DIR"] == str(tmp_path / "cache") and "WANDB_DATA_DIR" not in os.environ


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path: Path) -> None:
    """The event file holds every logged value under its grouped name at its step; a continued run
    purges the steps after its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), {}, True, 4, wandb_mode="disabled", progress=False, tensorboard=True) as m:
        for step in range(1, 5):
            m.log(step, {"loss": 3.0 / step, "lr": 1e-3 * step, "tokens_per_s": 100.0 + step})
        m.log_eval(4, 0.25)
    with MetricsLogger(str(tmp_path), {}, True, 4, wandb_mode="disabled", progress=False, tensorboard=True,
                       start_step=2) as m:
        for step in (3, 4):
            m.log(step, {"loss": 2.0 / step, "lr": 1e-3 * step, "tokens_per_s": 200.0 + step})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "lr", "tokens_per_s"):
        events = acc.Scalars(metric_name(key))
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert acc.Scalars("eval/loss") == []  # logged at step 4: purged by the resume at step 2


def test_tensorboard_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match="needs the tensorboard package") as e:
        TensorBoardSink(tmp_path, 0)
    assert str(e.value) == TENSORBOARD_MISSING and "\n" not in str(e.value)
