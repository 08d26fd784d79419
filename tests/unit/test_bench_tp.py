"""`hybrid.bench.tp` runs every section end to end at tiny sizes (no timing assertions: only that the
figures exist and the exact ones agree)."""

from __future__ import annotations

import pytest

from hybrid.bench import tp

TINY = ["--tp", "1", "2", "--param-model", "gpt-tiny", "--act-model", "gpt-tiny", "--act-layers", "2",
        "--act-seq", "32", "--model", "gpt-tiny", "--seq", "32", "--micro-batch", "2", "--global-batch", "8",
        "--steps", "1", "--warmup", "0", "--rounds", "2", "--timeout", "120"]


def test_every_section_runs_and_the_exact_figures_agree(capsys: pytest.CaptureFixture[str]) -> None:
    result = tp.run(tp.parse_args(TINY))
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


def test_cli_selects_sections_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert tp.main([*TINY, "--sections", "bytes"]) == 0
    out = capsys.readouterr().out
    assert "## bytes_tp" in out and "## params" not in out
    for bad in (["--sections", "nope"], ["--model", "no-such-model"], ["--seq", "33"]):
        with pytest.raises(SystemExit):
            tp.parse_args([*TINY, *bad])
