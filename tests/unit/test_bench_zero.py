"""`hybrid.bench.zero_prefetch` end to end at a tiny size (no timing asserted: figures only exist and add up)."""

from __future__ import annotations

import pytest

from hybrid.bench import zero_prefetch


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
