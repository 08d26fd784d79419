"""`hybrid.bench.zero_prefetch` and `zero_plus_plus` end to end at a tiny size (no timing asserted: figures only exist
and add up; counted bytes compared), and the ZeRO benchmarks' refusals of bad command lines."""

from __future__ import annotations

import pytest

from hybrid.bench import zero_plus_plus, zero_prefetch, zero_vs_fsdp2


def test_zero_prefetch_reports_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    got = zero_prefetch.run(zero_prefetch.parse_args(["--quick"]))
    assert set(got) == set(zero_prefetch.SIDES) and all(len(v) == 1 for v in got.values())
    for side, records in got.items():
        r = records[0]
        assert r["comm/dp/all_gather/s"] > 0 and 0 <= r["comm/dp/all_gather/exposed_s"], (side, r)
    assert "exposed / total" in capsys.readouterr().out


def test_zero_prefetch_refuses_a_single_rank() -> None:
    with pytest.raises(SystemExit):
        zero_prefetch.parse_args(["--dp", "1"])


def test_zero_plus_plus_counts_fewer_off_node_bytes_lever_by_lever(capsys: pytest.CaptureFixture[str]) -> None:
    """The bytes section at a tiny size: hpZ moves plain ZeRO-3's bytes with fewer off the node; the codecs fewer
    still; all three fewest; every figure > 0 (2 nodes); the table printed."""
    got = zero_plus_plus.run(zero_plus_plus.parse_args(["--quick", "--sections", "bytes", "--byte-steps", "1"]))
    b = got["bytes"]["gpt-tiny"]
    assert set(b) == {label for label, _ in zero_plus_plus.LAYOUTS}
    assert b["zero3+hpZ"]["dp"] == b["zero3"]["dp"] and b["zero3+hpZ"]["cross"] < b["zero3"]["cross"]
    assert 0 < b["ZeRO++"]["cross"] < b["zero3+qwZ+qgZ"]["cross"] < b["zero3"]["cross"]
    assert "off-node MiB/step" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--node", "4"], ["--node", "3"], ["--dp", "4", "--node", "1"]])
def test_zero_plus_plus_refuses_layouts_without_two_nodes_of_two(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        zero_plus_plus.parse_args(argv)


@pytest.mark.parametrize("argv", [["--sides", "fsdp2"], ["--sides", "zero3", "zero4"], ["--node", "4"]])
def test_zero_vs_fsdp2_refuses_sides_without_zero3_and_a_single_node(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        zero_vs_fsdp2.parse_args(argv)
