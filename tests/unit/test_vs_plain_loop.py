"""`bench.vs_plain_loop` on CPU: the plain loop is the same model (same first loss from the same weights and
data), the busy share is the union of the GPU's intervals, the figures are the ones printed, and hybrid's step
reads nothing into the host (0 syncs per step, counted on CPU by `record.host_syncs`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from hybrid.bench import vs_plain_loop as bench


def test_plain_loop_matches_hybrid_and_reports_paired_rounds(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "vs.json"
    args = bench.parse_args(["--quick", "--seq-len", "32", "--rounds", "2", "--steps", "1", "--profile-steps", "1",
                             "--device", "cpu", "--out", str(out)])
    result = bench.run(args)
    hybrid, plain = result["sides"]
    assert (hybrid["name"], plain["name"]) == ("hybrid", "plain") and json.loads(out.read_text()) == result
    assert plain["losses"][0] == pytest.approx(hybrid["losses"][0], rel=1e-5)  # fp32, same weights and data
    assert all(r > 0 for r in hybrid["rates"] + plain["rates"]) and len(hybrid["rates"]) == 2
    ratio = statistics.median(a / b for a, b in zip(hybrid["rates"], plain["rates"]))
    assert f"hybrid / plain: {ratio:.3f}×" in capsys.readouterr().out
    assert hybrid["gpu_busy"] is None and hybrid["step_ms"] > 0
    assert hybrid["syncs_per_step"] == 0  # a step that logs nothing reads nothing from the device (host_syncs)


def test_gpu_busy_is_the_union_of_intervals_inside_the_span() -> None:
    events = [{"cat": "kernel", "ts": 0, "dur": 40}, {"cat": "kernel", "ts": 30, "dur": 20},  # 0..50 overlapping
              {"cat": "gpu_memcpy", "ts": 60, "dur": 10}, {"cat": "cpu_op", "ts": 0, "dur": 100},
              {"cat": "kernel", "ts": 95, "dur": 50}]  # clipped at the span's end
    assert bench.gpu_busy(events, 0, 100) == pytest.approx((50 + 10 + 5) / 100)


@pytest.mark.parametrize("argv", [["--sides", "hybrid"], ["--sides", "hybrid,hybrid"], ["--sides", "hybrid,nope"],
                                  ["--rounds", "0"], ["--model", "nope"]])
def test_bad_arguments_are_one_parser_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2 and capsys.readouterr().err.count("error:") == 1
