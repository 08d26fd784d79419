"""`hybrid-plan --target`: the target read as a step time, the searches against closed forms, and each answer held
to the predictor itself (the layout re-predicted at the speed it names reaches the target, a little below it does
not); the command line's lines, JSON and bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybrid.config import compose_config
from hybrid.plan import target
from hybrid.plan.cost import shape_of
from hybrid.plan.hardware import Link, PlanError, preset
from hybrid.plan.predict import Candidate, predict
from hybrid.tools.plan import main


def test_a_target_is_a_step_time_whatever_its_unit() -> None:
    assert target.parse("1.5s", 1000, 8).step_s == 1.5
    assert target.parse("200000tok/s", 400000, 8).step_s == pytest.approx(2.0)
    assert target.parse("5000 tok/s/GPU", 400000, 8).step_s == pytest.approx(10.0)
    for bad in ("fast", "0s", "-1s", "3 furlongs"):
        with pytest.raises(PlanError, match="--target must be a step time or a throughput"):
            target.parse(bad, 1000, 8)


def test_the_least_speed_and_the_break_even_against_closed_forms() -> None:
    step = lambda bw: 1.0 + 4e9 / bw  # noqa: E731 - 1 s of compute, 4 GB over the link
    assert target.least_speed(step, 2.0, 10e9) == pytest.approx(4e9, rel=1e-6)
    assert target.least_speed(step, 0.9, 10e9) is None  # compute alone is 1 s
    assert target.least_speed(step, 1000.0, 10e9) == pytest.approx(10e9 / target.SPAN)  # any speed in range
    lossy = lambda bw: 1.2 + 1e9 / bw  # noqa: E731 - a codec's 0.2 s, a quarter of the bytes
    assert target.break_even(step, lossy, 10e9) == pytest.approx(15e9, rel=1e-6)  # 0.2 = 3e9 / bw
    assert target.break_even(step, lambda bw: step(bw) + 1.0, 10e9) is None  # never faster


def test_each_answer_is_held_to_the_predictor(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["model=gpt-tiny", "--cluster", "dgx-a100", "--nodes", "2", "--inter", "eth-100g", "--batch", "64",
            "--seq", "512", "--top", "3"]
    assert main([*argv, "--json"]) == 0
    fastest = json.loads(capsys.readouterr().out)["plans"][0]["step_s"]
    assert main([*argv, "--json", "--target", f"{fastest * 0.5}s"]) == 0  # out of reach: what infinite links leave
    floor = json.loads(capsys.readouterr().out)["target"]["layouts"][0]["unlimited_s"]
    goal_s = (fastest + floor) / 2  # within reach of the first layout
    assert main([*argv, "--json", "--target", f"{goal_s}s"]) == 0
    doc = json.loads(capsys.readouterr().out)
    shape = shape_of(compose_config(["model=gpt-tiny"]).model, 50257)
    cluster = replace(preset("dgx-a100", 2), inter=Link(10e9, 30e-6))
    goal = doc["target"]["step_s"]
    checked = 0
    for plan, a in zip(doc["plans"], doc["target"]["layouts"]):
        assert a["link"] == "inter" and a["now_gbps"] == pytest.approx(10.0) and not a["meets"]
        if a["needed_gbps"] is None:
            assert a["unlimited_s"] > goal
            continue
        c = replace(Candidate(**plan["layout"]), dp_exchange="auto")
        speeds = (a["needed_gbps"], a["needed_gbps"] * 0.99)
        at, below = (predict(shape, c, replace(cluster, inter=Link(s * 1e9, 30e-6)), 64, 512).step_s for s in speeds)
        assert at <= goal * (1 + 1e-9) < below
        checked += 1
    assert checked >= 1
    assert main([*argv, "--target", f"{goal_s}s"]) == 0
    out = capsys.readouterr().out
    assert f"target {goal_s}s: a step within" in out and "needs links between nodes of ≥" in out


def test_a_bad_target_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model=gpt-tiny", "--target", "soon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target must be a step time or a throughput" in err[0], err
