"""`hybrid.bench.tp_*` run every section end to end at tiny sizes (no timing assertions: only that the
figures exist and the exact ones agree)."""

from __future__ import annotations

import pytest

from hybrid.bench import tp_bytes, tp_memory, tp_throughput

TINY_MEMORY = ["--tp", "1", "2", "--param-model", "gpt-tiny", "--act-model", "gpt-tiny", "--act-layers", "2",
               "--act-seq", "32", "--timeout", "120"]
TRAIN = ["--model", "gpt-tiny", "--seq", "32", "--micro-batch", "2", "--global-batch", "8", "--timeout", "120"]
TINY_THROUGHPUT = [*TRAIN, "--steps", "1", "--warmup", "0", "--rounds", "2"]
TINY_BYTES = [*TRAIN, "--tp", "2"]


def test_every_section_runs_and_the_exact_figures_agree(capsys: pytest.CaptureFixture[str]) -> None:
    result = {**tp_memory.run(tp_memory.parse_args(TINY_MEMORY)),
              "throughput": tp_throughput.run(tp_throughput.parse_args(TINY_THROUGHPUT)),
              "bytes": tp_bytes.run(tp_bytes.parse_args(TINY_BYTES))}
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
    assert tp_bytes.main(TINY_BYTES) == 0
    assert set(tp_memory.run(tp_memory.parse_args([*TINY_MEMORY, "--sections", "params"]))) == {"params"}
    out = capsys.readouterr().out
    assert "## bytes_tp" in out and "## params" in out and "## activations" not in out
    assert tp_throughput.parse_args(["--quick"]).rounds == 2 and tp_bytes.parse_args(["--quick"]).tp == [2]
    for module, bad in ((tp_memory, [*TINY_MEMORY, "--sections", "nope"]), (tp_throughput, [*TRAIN, "--model",
                        "no-such-model"]), (tp_bytes, [*TINY_BYTES, "--seq", "33"])):
        with pytest.raises(SystemExit):
            module.parse_args(bad)
