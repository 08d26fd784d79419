"""`hybrid.bench.tp_*` run every section end to end at tiny sizes (no timing assertions: only that the
figures exist and the exact ones agree)."""

from __future__ import annotations

import argparse

import pytest
import torch

from hybrid.bench import tp_bytes, tp_chunk_cost, tp_memory, tp_overlap, tp_throughput

TINY_MEMORY = ["--tp", "1", "2", "--param-model", "gpt-tiny", "--act-model", "gpt-tiny", "--act-layers", "2",
               "--act-seq", "32", "--timeout", "120"]
TRAIN = ["--model", "gpt-tiny", "--seq", "16", "--micro-batch", "2", "--global-batch", "4", "--timeout", "120"]


def test_every_section_runs_and_the_exact_figures_agree(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every section at tiny sizes (tp_throughput and tp_bytes in --quick mode), tp_bytes through its `main`:
    exit status 0 with every counted figure equal to the formula."""
    bytes_rows, real_run = [], tp_bytes.run

    def recorded(args: argparse.Namespace) -> list[dict]:
        bytes_rows.extend(real_run(args))
        return bytes_rows

    monkeypatch.setattr(tp_bytes, "run", recorded)
    assert tp_bytes.main(["--quick"]) == 0
    result = {**tp_memory.run(tp_memory.parse_args(TINY_MEMORY)),
              "throughput": tp_throughput.run(tp_throughput.parse_args(["--quick"])), "bytes": bytes_rows}
    out = capsys.readouterr().out
    for needle in ("# command: OMP_NUM_THREADS=1", "## params", "## activations", "## throughput", "## bytes_tp",
                   "Megatron", "reproduce:"):
        assert needle in out

    params = {r["tp"]: r for r in result["params"]}
    assert params[1]["ratio"] == 1.0 and 1.0 < params[2]["ratio"] <= 1.05  # replicated norms/positions exceed 1/t

    acts = {(r["tp"], r["sp"]): r for r in result["activations"]}
    assert set(acts) == {(1, False), (2, False), (2, True)}
    assert acts[2, False]["layers"] < acts[1, False]["layers"]
    assert acts[2, True]["layers"] < acts[2, False]["layers"]  # SP splits norms' and linear inputs' activations

    thr = result["throughput"]
    assert set(thr["times"]) == {"tp1·dp2", "tp2", "tp2+SP"}
    assert all(len(t) == 2 and min(t) > 0 for t in thr["times"].values())
    first = {name: losses[0] for name, losses in thr["losses"].items()}
    assert first["tp2"] == pytest.approx(first["tp1·dp2"], abs=1e-4)  # same model, data and global batch
    assert first["tp2+SP"] == pytest.approx(first["tp1·dp2"], abs=1e-4)

    assert [(r["tp"], r["sp"]) for r in result["bytes"]] == [(2, False), (2, True)]
    assert all(r["equal"] for r in result["bytes"]), result["bytes"]


def test_cli_selects_sections_and_rejects_bad_input(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_bytes, "run", lambda args: [{"equal": True}, {"equal": False}])
    assert tp_bytes.main(["--quick"]) == 1  # a counted figure off its formula
    assert set(tp_memory.run(tp_memory.parse_args([*TINY_MEMORY, "--sections", "params"]))) == {"params"}
    out = capsys.readouterr().out
    assert "## params" in out and "## activations" not in out
    assert tp_throughput.parse_args(["--quick"]).rounds == 2 and tp_bytes.parse_args(["--quick"]).tp == [2]
    for module, bad in ((tp_memory, [*TINY_MEMORY, "--sections", "nope"]), (tp_throughput, [*TRAIN, "--model",
                        "no-such-model"]), (tp_bytes, [*TRAIN, "--tp", "2", "--seq", "33"])):
        with pytest.raises(SystemExit):
            module.parse_args(bad)


def test_tp_overlap_bench_runs_every_mode_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """The overlap benchmark in --quick mode: every mode timed every round; blocking hides nothing."""
    got = tp_overlap.run(tp_overlap.parse_args(["--quick"]))
    assert set(got["got"]) == {"none", "bulk", "chunked"}
    assert all(len(records) == 2 for records in got["got"].values())
    assert all(r["comm/overlap_tp"] == 0.0 and r["comm/tp/exposed_s"] > 0 for r in got["got"]["none"])
    assert all(r["comm/tp/s"] > 0 for records in got["got"].values() for r in records)
    assert set(got["ratios"]) == {"bulk", "chunked"}
    assert "chunked's exposed TP time" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tp_overlap.parse_args(["--quick", "--chunks", "3"])  # not a multiple of tp


def test_tp_chunk_cost_bench_runs_the_chunked_path_on_one_device(capsys: pytest.CaptureFixture[str]) -> None:
    got = tp_chunk_cost.run(tp_chunk_cost.parse_args(["--quick"]))
    assert [r["pieces"] for r in got["rows"]] == [2, 4]
    assert all(r["whole_ms"] > 0 and r["pieced_ms"] > 0 for r in got["rows"])
    x = torch.randn(1, 8, 4, dtype=torch.float64)
    up, down = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(tp_chunk_cost.pieced(x, up, down, 4), tp_chunk_cost.whole(x, up, down))
    assert "pieced / whole" in capsys.readouterr().out
