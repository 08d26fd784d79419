"""`hybrid.bench.cp_memory`, `cp_overlap`, `cp_longest` and `cp_kernels` end to end at tiny sizes (no timing
assertions: the figures exist, and the exact ones — bytes saved for the backward, the estimate — agree)."""

from __future__ import annotations

import pytest

from hybrid.bench import cp_kernels, cp_longest, cp_memory, cp_overlap


@pytest.mark.parametrize("comm", ["ring", "a2a"])
def test_cp_memory_halves_what_a_rank_saves_and_follows_the_estimate(comm: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Also the all-to-all's estimate: the kernel over cp× the tokens and 1/cp of the heads, and the output
    brought back."""
    rows = {r["cp"]: r for r in cp_memory.run(cp_memory.parse_args(["--quick", "--comm", comm]))}
    assert set(rows) == {1, 2} and abs(rows[1]["saved"] / rows[1]["estimate"] - 1) < 0.01
    assert 0.45 < rows[2]["saved"] / rows[1]["saved"] < 0.55  # the attention's kept bytes are per local token too
    assert abs(rows[2]["saved"] / rows[2]["estimate"] - 1) < 0.01
    assert "saved vs cp1" in capsys.readouterr().out


def test_cp_overlap_reports_every_side(capsys: pytest.CaptureFixture[str]) -> None:
    got = cp_overlap.run(cp_overlap.parse_args(["--quick", "--rounds", "1", "--layers", "1", "--seq", "64"]))
    assert set(got) == set(cp_overlap.SIDES) and all(len(v) == 1 for v in got.values())
    assert got["ring"][0]["comm/cp/s"] > 0 and 0 <= got["ring"][0]["comm/overlap_cp"] <= 1
    assert got["cp1"][0]["comm/cp/s"] == 0.0
    assert "overlap_cp" in capsys.readouterr().out


def test_cp_longest_measures_then_launches_the_longest_predicted_to_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """A budget of 100 GiB: every length fits, so the search doubles from --start to --max."""
    args = cp_longest.parse_args(["--quick", "--cp", "2", "--start", "128", "--grain", "128", "--max", "512",
                                  "--budget-gib", "100"])
    results = cp_longest.run(args)
    assert [r["cp"] for r in results] == [2]
    for r in results:
        assert [x["seq"] for x in r["runs"]] == [128, 256, 512] and all(x["fits"] for x in r["runs"])
        assert r["longest"] == 512 and r["next"] == 640 and all(x["rss"] > 0 for x in r["runs"])
    assert "longest tokens" in capsys.readouterr().out


def test_cp_longest_refuses_a_cp_that_does_not_divide_the_world() -> None:
    with pytest.raises(SystemExit):
        cp_longest.parse_args(["--world", "8", "--cp", "3"])


def test_cp_longest_stops_at_the_longest_grain_the_line_predicts_to_fit() -> None:
    """Launches faked on a line (1 GiB + 1 MiB a token, budget 2.9 GiB): 512 and 1,024 fit, 2,048 is predicted
    not to, so 1,536 is launched — and no length past it."""
    seen: list[int] = []

    def fake(args, cp, seq, budget, out):  # noqa: ANN001, ANN202
        seen.append(seq)
        rss = cp_longest.GIB + seq * 2**20
        return {"cp": cp, "seq": seq, "rss": rss, "fits": rss <= budget, "step_s": 0.0}

    args = cp_longest.parse_args(["--cp", "1", "--start", "512", "--grain", "512", "--max", "65536"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cp_longest, "_launch", fake)
        got = cp_longest.search(args, 1, 2.9 * cp_longest.GIB, print)
    assert seen == [512, 1024, 1536] and got["longest"] == 1536 and got["next"] == 2048
    assert got["next_predicted"] == cp_longest.GIB + 2048 * 2**20


def test_cp_kernels_ring_blocks_at_cp1_are_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    got = cp_kernels.run(cp_kernels.parse_args(["--quick", "--device", "cpu"]))
    assert got["max_diff"] < 1e-4 and set(got["median_s"]) == {"sdpa", "ring_cp1"}
    assert "vs sdpa" in capsys.readouterr().out
