"""`hybrid.bench.compression`: its pure parts, and every section end to end in `--quick` mode (no timing
assertions: only that the figures exist, the exact ones agree and the wire ratios meet the issue's targets)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from hybrid.bench import compression as bench
from hybrid.bench.ranks import launch


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HYBRID_CACHE for the default corpus: the caller's if set (built once), else a fresh folder."""
    old = os.environ.get("HYBRID_CACHE")
    os.environ["HYBRID_CACHE"] = old or str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["HYBRID_CACHE"]


def test_quick_defaults_reproduce_command_and_cli() -> None:
    args = bench.parse_args(["--quick", "--steps", "7"])
    assert args.model == "gpt-tiny" and args.dp == [2] and args.speed_mb == [4]
    assert args.steps == 7  # an explicit option wins over QUICK's
    command = bench.reproduce_command(args)
    assert "--quick" not in command and "--steps 7" in command and "--model gpt-tiny" in command
    assert "--sections speed " in bench.reproduce_command(args, ["speed"])
    assert bench.parse_args([]).model == "gpt-125m"
    for bad in (["--sections", "nope"], ["--dp", "3"], ["--model", "no-such-model"], ["--global-batch", "7"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_formulas_and_breakeven_model() -> None:
    shapes = bench.bucket_shapes("gpt-tiny")
    numel = sum(s.numel() for b in shapes for s in b)
    none = bench.compression_cfg(["compression=none"])
    assert bench.formula_payload(none, shapes, 4, 2, 0) == {"dp": 4 * numel}
    assert bench.formula_ratio("fp16", shapes, 8) == pytest.approx(2.0)
    assert bench.formula_ratio("topk", shapes, 4) == pytest.approx(50.0, rel=1e-3)  # 1/(2·1%)
    hier = bench.compression_cfg(["compression=hierarchical", "compression.inner=int8"])
    parts = bench.formula_payload(hier, shapes, 4, 2, 1)
    assert set(parts) == {"dp_intra", "dp_inter"} and parts["dp_intra"] >= 2 * 4 * numel
    # B* = S(1 − 1/R)/t_c: ratio 2 at n=2 saves half of 1 MiB; 1 ms per MiB → 2^19 bytes per ms
    assert bench.breakeven_gbps(2, 2.0, 1.0) == pytest.approx(2**19 * 1000 / 1e9)
    assert bench.hook_compute_ms("int8", {"compress": 1.0, "decompress": 1.0}, 4, False) == pytest.approx(3.25)
    assert bench.hook_compute_ms("powersgd", {"compress": 1.0, "decompress": 2.0}, 8, True) == 3.0
    assert bench.table(["name", "ratio"], [["x", "1.50×"], ["4 MiB", "-"]]) == [
        "| name  | ratio |", "|-------|-------|", "| x     | 1.50× |", "| 4 MiB | -     |"]  # numbers right-aligned


def test_alone_and_whole_steps_count_the_same_bytes() -> None:
    methods = [(label, bench.compression_cfg(o)) for label, o in bench.BYTES_METHODS
               if label in ("sign", "torch_powersgd", "hier+int8")]
    whole, alone = (launch(bench.bytes_rank, 4, "gpt-tiny", methods, flag, timeout=120)[0] for flag in (False, True))
    assert [r["payload"] for r in whole] == [r["payload"] for r in alone]
    assert whole[2]["payload"].keys() == {"dp_intra", "dp_inter"}


def test_quick_run_every_section(cache: None, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        result = bench.run(bench.parse_args(["--quick"]))
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for needle in ("## bytes", "## parity", "## speed", "## breakeven", "B* = S·(1 − 1/R) / t_c", "PowerSGD pair",
                   "reproduce: OMP_NUM_THREADS=1"):
        assert needle in out
    rows = {r["method"]: r for r in result["bytes"]}
    assert set(rows) == {label for label, _ in bench.BYTES_METHODS}
    assert all(r["equal"] for r in rows.values()), [r for r in rows.values() if not r["equal"]]
    assert all(r["pass"] for r in rows.values() if r["target"]), "a wire ratio missed the issue's target"
    assert rows["torch_powersgd"]["payload"] == rows["powersgd"]["payload"]
    parity = result["parity"]
    assert len(parity) == len(bench.PARITY_RUNS) and all(r["eval"] > 0 for r in parity)
    assert all(r["ratio"] == pytest.approx(1.0) for r in parity if r["method"] == "none")
    pair = [r for r in parity if "powersgd" in r["method"] and r["warmup"] == 2]
    assert len(pair) == 2 and pair[0]["bytes_dp"] == pair[1]["bytes_dp"]  # ours and torch's: the same bytes
    assert {r["method"] for r in result["speed"]} == set(bench.SPEED_METHODS)
    assert all(r["compress"] > 0 and r["decompress"] > 0 for r in result["speed"])
    assert all(row[n]["gbps"] > 0 for row in result["breakeven"] for n in (4, 8))
