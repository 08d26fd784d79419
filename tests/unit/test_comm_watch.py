"""The communication alerts (`hybrid.comm_watch`) on made-up records: exact figures, so every verdict is the rule's.

References: the rule written out by hand (worse = bus bandwidth below baseline / slowdown, or exposed time above
baseline × slowdown, with the group's share of the step up by at least `comm_min_share`, for `comm_checks`
checks in a row); the ranks named from made-up per-rank seconds; `group_seconds` against `local_vector`'s layout.
Steady series carry ±30 % noise (a fixed seed), far inside the threshold; slowdowns are 10× or more, far beyond it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from hybrid.comm_watch import CommDegraded, CommWatch, Figures, instances, read_preflight, slow_instances, worse
from hybrid.config import ConfigError, HealthConfig
from hybrid.parallel.collectives import CommCounter
from hybrid.parallel.layout import Layout
from hybrid.parallel.timing import StepTiming
from hybrid.record.comm_report import GROUPS, group_seconds, local_vector

LAYOUT = Layout.create(4, tp=2, dp=2, ranks_per_node=2)  # tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3]
DP_BYTES = 4e6
LOCAL = local_vector(StepTiming(), CommCounter(), 0.0)  # this rank's vector (its seconds are the made-up gather's)


def record(step_s: float, dp_s: float, dp_exposed: float, tp_s: float = 0.002, dp_bytes: float = DP_BYTES
           ) -> dict[str, Any]:
    """A timed record as `comm_report.record` writes it: a dp group all-reducing `dp_bytes`, a small tp group."""
    out: dict[str, Any] = {"time/step_s": step_s}
    for g, s, exposed, nbytes, op in (("dp", dp_s, dp_exposed, dp_bytes, "all_reduce"),
                                      ("tp", tp_s, tp_s, 1e4, "all_reduce")):
        out |= {f"comm/{g}/s": s, f"comm/{g}/exposed_s": exposed, f"comm/{g}/busbw_gbps": nbytes / s / 1e9,
                f"comm/{g}/{op}/s": s, f"comm/{g}/{op}/bytes": nbytes, f"comm/{g}/loss/s": s / 100}
    return out


class Ranks:
    """The all-gather an alert makes, made up: every rank's seconds per group (dp ranks 0 and 2 slow)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, mine: list[float]) -> list[list[float]]:
        self.calls += 1
        dp = GROUPS.index("dp")
        return [[0.5 if (g == dp and r in (0, 2)) else 0.01 for g in range(len(mine))] for r in range(4)]


def watch(lines: Optional[list[str]] = None, **cfg: Any) -> CommWatch:
    return CommWatch(HealthConfig(**cfg), LAYOUT, (lines if lines is not None else []).append, Ranks())


def feed(w: CommWatch, records: list[dict[str, Any]], first: int = 1) -> list[dict[str, Any]]:
    return [w.check(first + i, r, LOCAL) for i, r in enumerate(records)]


def steady(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` records of a 0.1 s step with a 0.03 s dp exchange (0.01 s exposed), each figure within ±30 %."""
    rng = random.Random(seed)
    jitter = lambda: rng.uniform(0.7, 1.3)  # noqa: E731
    return [record(0.1 * jitter(), 0.03 * jitter(), 0.01 * jitter()) for _ in range(n)]


def test_a_steady_run_of_500_checks_never_alerts() -> None:
    lines: list[str] = []
    w = watch(lines)
    feed(w, steady(500))
    assert w.alerts == [] and lines == [] and "dp" in w.base and "tp" in w.base


def test_a_link_slowed_tenfold_alerts_once_after_comm_checks_checks_naming_group_op_figures_and_ranks() -> None:
    lines: list[str] = []
    w = watch(lines)
    feed(w, steady(20))  # 3 warm-up, 5 baseline, 12 checked
    slow = [record(0.1 + 0.27, 0.3, 0.28) for _ in range(6)]  # the dp exchange 10× longer, its wait on the step
    out = feed(w, slow, first=21)
    assert [o["health/comm_alerts"] for o in out] == [0, 0, 2, 2, 2, 2]  # the 3rd check in a row: busbw and exposed
    assert [(a.step, a.group, a.figure, a.op) for a in w.alerts] == [(23, "dp", "busbw", "all_reduce"),
                                                                     (23, "dp", "exposed", "all_reduce")]
    base = w.base["dp"]
    assert w.alerts[0].before == base.busbw and w.alerts[0].now == pytest.approx(DP_BYTES / 0.3 / 1e9)
    assert w.alerts[1].before == base.exposed and w.alerts[1].now == 0.28
    assert all(a.ranks == [[0, 2]] for a in w.alerts) and w.gather.calls == 1  # one all-gather for both lines
    line = lines[0]
    assert line.startswith("warning: communication: dp all_reduce bus bandwidth fell from ")
    assert " to 0.0133 GB/s (" in line, line
    assert "3 checks in a row to step 23 (health.comm_slowdown=2)" in line, line
    assert "ranks [0, 2] 0.5 s against 0.01 s in the fastest of 2 groups" in line, line
    assert "exposed time rose from" in lines[1] and "to 0.28 s per step" in lines[1], lines[1]
    assert w.summary()["alerts"][0]["line"] == line and len(lines) == 2


def test_the_alert_is_rearmed_only_after_the_figure_recovers() -> None:
    w = watch()
    feed(w, steady(10))
    slow = [record(0.37, 0.3, 0.28)] * 5
    feed(w, slow + steady(2, seed=1) + slow, first=11)
    assert [a.step for a in w.alerts if a.figure == "busbw"] == [13, 20]


def test_a_machine_slower_as_a_whole_is_not_a_communication_alert() -> None:
    w = watch()
    feed(w, steady(10))
    feed(w, [record(0.3, 0.09, 0.03)] * 20, first=11)  # everything 3× slower: the shares do not move
    assert w.alerts == []


def test_a_small_exchange_slowed_tenfold_stays_quiet_below_the_minimum_share() -> None:
    w = watch()
    feed(w, [record(0.1, 0.03, 0.01, tp_s=0.0002)] * 10)
    feed(w, [record(0.1018, 0.03, 0.01, tp_s=0.002)] * 10, first=11)  # tp: 10× slower, 0.2 % → 2 % of the step
    assert w.alerts == []
    feed(w, [record(0.15, 0.03, 0.01, tp_s=0.05)] * 3, first=21)  # … and at a third of the step it does alert
    assert {(a.group, a.figure) for a in w.alerts} == {("tp", "busbw"), ("tp", "exposed")}


def test_overlap_lost_is_an_exposed_time_alert() -> None:
    w = watch()
    feed(w, [record(0.1, 0.03, 0.0)] * 10)  # fully hidden
    feed(w, [record(0.13, 0.03, 0.03)] * 3, first=11)  # the same exchange, now waited for
    assert [(a.group, a.figure, a.before, a.now) for a in w.alerts] == [("dp", "exposed", 0.0, 0.03)]


def test_a_wait_uncovered_by_faster_compute_is_not_an_alert() -> None:
    """Seen under CI load: the baseline settled while the machine was busy (slow compute hid most of the exchange),
    then compute sped up and the same exchange was waited for — the exposed time 2.4×, the step no longer."""
    w = watch()
    feed(w, [record(0.03, 0.0155, 0.0088)] * 10)
    feed(w, [record(0.028, 0.0155, 0.0208)] * 10, first=11)
    assert w.alerts == []


def test_another_exchange_of_other_bytes_is_not_checked() -> None:
    w = watch()
    feed(w, steady(10))
    feed(w, [record(0.5, 0.4, 0.4, dp_bytes=DP_BYTES * 10)] * 5, first=11)  # a bigger sync, not a slower one
    assert w.alerts == []


def test_an_exchange_that_changes_for_good_is_the_new_baseline() -> None:
    w = watch()
    feed(w, steady(10))
    int8 = [record(0.08, 0.01, 0.004, dp_bytes=DP_BYTES / 4)] * 5  # the auto schedule switched to int8
    feed(w, int8, first=11)
    assert w.alerts == [] and w.base["dp"].nbytes == DP_BYTES / 4 and w.base["dp"].s == 0.01
    feed(w, [record(0.1, 0.05, 0.03, dp_bytes=DP_BYTES / 4)] * 3, first=16)  # … and its link then slows
    assert [(a.step, a.figure) for a in w.alerts] == [(18, "busbw"), (18, "exposed")]


def test_untimed_records_and_comm_checks_0_watch_nothing() -> None:
    w = watch()
    assert w.check(1, {"loss": 1.0}, None) == {} and w.timed == 0
    off = watch(comm_checks=0)
    feed(off, steady(10) + [record(0.37, 0.3, 0.28)] * 5)
    assert off.alerts == [] and off.base == {}


def test_comm_action_stop_raises_after_the_line_with_the_record() -> None:
    lines: list[str] = []
    w = watch(lines, comm_action="stop", comm_checks=1, comm_warmup=0, comm_baseline=2)
    feed(w, steady(2))
    with pytest.raises(CommDegraded, match=r"^communication degraded, stopping \(health.comm_action=stop\): dp ") as e:
        w.check(3, record(0.37, 0.3, 0.28), LOCAL)
    assert e.value.record["health/comm_alerts"] == 2 and e.value.record["comm/dp/s"] == 0.3 and len(lines) == 2


def test_worse_is_the_rule_written_out() -> None:
    cfg = HealthConfig()
    base = Figures(s=0.03, exposed=0.001, busbw=1.0, step=0.1, nbytes=1e6)
    assert worse(base, Figures(0.07, 0.001, 0.49, 0.14, 1e6), cfg) == ["busbw"]  # 0.49 < 1/2, share 30 % → 50 %
    assert worse(base, Figures(0.07, 0.001, 0.51, 0.14, 1e6), cfg) == []  # not below half
    assert worse(base, Figures(0.03, 0.0021, 1.0, 0.1011, 1e6), cfg) == []  # exposed 2.1× but +1.1 % of the step
    assert worse(base, Figures(0.03, 0.0021, 1.0, 0.1011, 1e6), HealthConfig(comm_min_share=0.01)) == ["exposed"]
    # the same wait uncovered by faster compute: exposed 20× and 45 % of the step, the step no longer
    assert worse(base, Figures(0.03, 0.02, 1.0, 0.044, 1e6), cfg) == []


def test_the_ranks_named_are_the_slow_instances_or_all_alike() -> None:
    assert instances(LAYOUT, "dp") == [[0, 2], [1, 3]] and instances(LAYOUT, "tp") == [[0, 1], [2, 3]]
    assert instances(Layout.create(8, tp=2, cp=2, ranks_per_node=8), "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    groups = instances(Layout.create(8, dp=8), "dp")
    assert slow_instances(groups, [0.2] * 8, 2.0) == (groups, "ranks [0, 1, 2, 3, 4, 5, 6, 7] (the only such group, "
                                                               "0.2 s each)")
    four = [[0, 1], [2, 3], [4, 5], [6, 7]]
    named, text = slow_instances(four, [0.1, 0.1, 0.1, 0.1, 0.9, 0.8, 0.1, 0.1], 2.0)
    assert named == [[4, 5]] and text == "ranks [4, 5] 0.85 s against 0.1 s in the fastest of 4 groups"
    named, text = slow_instances(four, [0.1] * 8, 2.0)
    assert named == four and text.startswith("all 4 groups alike ([0, 1] 0.1 s, [2, 3] 0.1 s, [4, 5] 0.1 s, ")


def test_group_seconds_reads_each_groups_seconds_from_the_local_vector() -> None:
    t = StepTiming(step_s=1.0, group_s={"dp": 0.25, "pp": 0.5, "ps": 0.125}, exposed_s={"dp": 0.1})
    seconds = dict(zip(GROUPS, group_seconds(local_vector(t, CommCounter(), 0.0))))
    assert seconds == {g: {"dp": 0.25, "pp": 0.5, "ps": 0.125}.get(g, 0.0) for g in GROUPS}


def test_the_preflight_figure_is_quoted_and_a_bad_file_is_one_config_error(tmp_path: Path) -> None:
    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"world": 4, "allreduce": {"bytes": 67108864, "busbw_gbps": 3.5}}))
    lines: list[str] = []
    w = watch(lines, comm_preflight=str(path), comm_checks=1)
    feed(w, steady(8) + [record(0.37, 0.3, 0.28)])
    assert lines[0].endswith("; the preflight measured 3.5 GB/s bus bandwidth for a 67108864 B all_reduce over 4 ranks")
    assert read_preflight("") is None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"health.comm_preflight: .*bad.json is not a .* result \(KeyError"):
        read_preflight(str(tmp_path / "bad.json"))
