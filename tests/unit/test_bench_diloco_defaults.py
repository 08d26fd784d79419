"""`hybrid.bench.diloco_defaults` end to end in `--quick` mode (no timing or loss assertions: every run has its
figures, and the exact ones — H, the outer step, the inter-node bytes — agree with their formulas)."""

from __future__ import annotations

import pytest

from hybrid.bench import diloco_defaults


@pytest.mark.timeout(600)
def test_quick_rows_follow_the_defaults(cache: None) -> None:
    """4 steps: the defaults' H is 1 (4 // 20, at least 1), so they send sync DP's bytes (one node share per step)
    and the paper's pinned step too; local SGD's H=50 sends only the final sync: 4× fewer; int8's outer exchange
    sends half its payload on the wire. None of them meets the goal at 4 steps. An --also run whose rule agrees with
    any cosine after one round switches after step 2 (round 1 has no earlier Δ̄), and --trace prints its cosines."""
    lines: list[str] = []
    forced = "forced=sync.outer_switch_cos=-1,sync.outer_switch_window=1,sync.outer_switch_left=0"
    args = diloco_defaults.parse_args(["--quick", "--also", forced, "--trace"])
    rows = {r["label"]: r for r in diloco_defaults.run(args, lines.append)}
    assert list(rows) == ["sync DP", "diloco defaults", "diloco defaults, int8", "local_sgd", "paper's outer step",
                          "forced"]
    assert [r["h"] for r in rows.values()] == [1, 1, 1, 50, 1, 1]
    assert rows["forced"]["outer"] == "auto: Nesterov after step 2" and len(rows["forced"]["cosines"]) == 3
    trace = "forced: cos of consecutive mean pseudo-gradients by round (H=1): nan "
    assert any(line.startswith(trace) for line in lines)
    assert rows["diloco defaults"]["outer"] == "auto: average" and rows["local_sgd"]["outer"] == "average"
    assert rows["paper's outer step"]["outer"] == "lr 0.7 μ 0.9"
    assert rows["diloco defaults"]["inter"] == rows["sync DP"]["inter"] == rows["paper's outer step"]["inter"]
    assert rows["local_sgd"]["fewer"] == pytest.approx(4.0)
    int8 = rows["diloco defaults, int8"]
    assert int8["wire"] == int8["inter"] / 2 and int8["fewer_wire"] == pytest.approx(2 * int8["fewer"])
    assert rows["sync DP"]["pass"] is None and not any(r["pass"] for r in rows.values())
    assert any(line.startswith("| diloco defaults ") for line in lines)
