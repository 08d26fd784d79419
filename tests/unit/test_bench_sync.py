"""`hybrid.bench.sync_modes` and `hybrid.bench.sync_slow_links` end to end in `--quick` mode (no timing
assertions: the figures exist, and the exact ones — inter-node bytes — agree with their formulas)."""

from __future__ import annotations

import pytest

from hybrid.bench import sync_modes, sync_slow_links


@pytest.mark.timeout(600)
def test_sync_modes_quick_bytes_follow_the_modes(cache: None) -> None:
    """S steps (--quick's) at H=2 on 2 nodes × 2, in units of a rank's fp32 model M: hierarchical sync DP sends
    M/2 between nodes per step (a rank's half after the node's reduce-scatter); DiLoCo and local SGD M/2 per
    outer step (each rank its half of the parameters); gossip's ring M to its neighbour on the other node in
    each of S − 1 rounds, then M to the final average; the parameter server M out and M back for each of node
    1's two workers every step, and M out for their stop message (an any-source receive takes one size; per
    rank: the 4 ranks' mean). On the wire: the fp32 rows their payload, int8's outer step half its own."""
    lines: list[str] = []
    args = sync_modes.parse_args(["--quick", "--codecs", "none", "int8"])
    rows = {r["label"]: r for r in sync_modes.run(args, lines.append)}
    assert set(rows) == {"sync DP", "DiLoCo H=2 none", "DiLoCo H=2 int8", "local SGD H=2", "gossip ring", "PS sync",
                         "PS async k=2"}
    m, s, outer = rows["sync DP"]["model"], args.steps, args.steps // 2
    assert outer >= 1 and args.inner_steps == [2]
    ps = 2 * (s * 2 * m + m) / 4
    expected = {"sync DP": s * m / 2, "DiLoCo H=2 none": outer * m / 2, "local SGD H=2": outer * m / 2,
                "gossip ring": (s - 1) * m + m, "PS sync": ps, "PS async k=2": ps}
    for label, want in expected.items():
        assert rows[label]["inter"] == pytest.approx(want, rel=1e-4), label  # PS: its headers' few bytes
        assert rows[label]["wire"] == rows[label]["inter"]  # fp32 all-reduces between 2 nodes send their payload
    int8 = rows["DiLoCo H=2 int8"]  # an all-to-all and an all-gather between 2 nodes: each sends half its payload
    assert int8["wire"] == int8["inter"] / 2 and 0 < int8["inter"] < rows["DiLoCo H=2 none"]["inter"]
    assert all(r["eval"] > 0 for r in rows.values())
    assert any(line.startswith("| DiLoCo H=2 none") for line in lines)


@pytest.mark.timeout(600)
def test_slow_links_quick_times_every_mode_under_every_condition(cache: None) -> None:
    lines: list[str] = []
    times = sync_slow_links.run(sync_slow_links.parse_args(["--quick"]), lines.append)
    assert set(times) == set(sync_slow_links.CONDITIONS)
    assert all(len(blocks) == 2 and min(blocks) > 0 for per_mode in times.values() for blocks in per_mode)
    assert sum(line.startswith("| slow link") for line in lines) == len(sync_slow_links.modes(2))
