"""The timer's arithmetic against references: interval unions against a brute-force sweep, the record's
bandwidths against nccl-tests' definitions, the breakdown adding up to the step."""

from __future__ import annotations

import random
import threading
import time

import pytest

from hybrid.parallel.clocks import HostClock, Span
from hybrid.parallel.collectives import CommCounter, bus_factor
from hybrid.parallel.timing import CommTimer, resolve, union_length
from hybrid.record import comm_report


def brute_union(intervals: list[tuple[float, float]], step: float = 1e-3) -> float:
    """Count the grid points covered by some interval (the reference)."""
    points = {round(k * step, 6) for a, b in intervals for k in range(round(a / step), round(b / step))}
    return len(points) * step


def test_union_length_matches_a_brute_force_sweep() -> None:
    rng = random.Random(0)
    for _ in range(50):
        ivals = []
        for _ in range(rng.randint(0, 8)):
            a = rng.randint(0, 900) / 1000
            ivals.append((a, a + rng.randint(1, 200) / 1000))
        assert union_length(ivals) == pytest.approx(brute_union(ivals), abs=1e-9)


def timing_of(spans: list[Span], phases: list[tuple[str, float, float]], step_s: float):  # noqa: ANN201
    return resolve(HostClock(), 0.0, step_s, spans, phases)


def test_record_bandwidth_overlap_and_breakdown() -> None:
    counter = CommCounter()
    counter.bytes[("dp", "all_reduce")] = 8_000_000
    counter.calls[("dp", "all_reduce")] = 2
    counter.bytes[("tp", "all_gather")] = 1_000_000
    counter.calls[("tp", "all_gather")] = 1
    spans = [Span("dp", "all_reduce", "async", 0.2, 0.6), Span("dp", "all_reduce", "async", 0.5, 0.8),
             Span("dp", "wait", "wait", 0.7, 0.8, exposed=True),
             Span("tp", "all_gather", "blocking", 0.1, 0.15, exposed=True)]
    phases = [("data", 0.0, 0.05), ("forward", 0.05, 0.3), ("backward", 0.3, 0.7), ("optimizer", 0.8, 0.95)]
    t = timing_of(spans, phases, 1.0)
    sizes = {"dp": 4, "tp": 2}
    rec = comm_report.record(comm_report.local_vector(t, counter, 0.0), 1, sizes)
    assert rec["comm/dp/all_reduce/s"] == pytest.approx(0.6)  # the union of 0.2–0.6 and 0.5–0.8
    assert rec["comm/dp/all_reduce/algbw_gbps"] == pytest.approx(8e6 / 0.6 / 1e9)
    assert rec["comm/dp/all_reduce/busbw_gbps"] == pytest.approx(8e6 / 0.6 / 1e9 * bus_factor("all_reduce", 4))
    assert rec["comm/tp/all_gather/busbw_gbps"] == pytest.approx(1e6 / 0.05 / 1e9 * bus_factor("all_gather", 2))
    assert rec["comm/overlap_dp"] == pytest.approx(1 - 0.1 / 0.6)
    assert rec["comm/overlap_tp"] == 0.0  # a blocking all-gather: nothing hidden
    assert rec["time/compute_s"] == pytest.approx(0.25 + 0.4 - 0.05)  # the TP wait inside forward taken out
    parts = [k for k in rec if k.startswith("time/") and k not in ("time/step_s", "time/other_s")]
    assert sum(rec[k] for k in parts) + rec["time/other_s"] == pytest.approx(rec["time/step_s"])


def test_tp_overlap_is_the_share_of_the_rings_time_not_waited_for() -> None:
    """Chunked TP: hops in flight (async) while the GEMMs run, the thread waiting on some of them."""
    spans = [Span("tp", "all_gather", "async", 0.1, 0.3), Span("tp", "reduce_scatter", "async", 0.4, 0.6),
             Span("tp", "all_gather", "wait", 0.28, 0.3, exposed=True),
             Span("tp", "reduce_scatter", "wait", 0.5, 0.6, exposed=True)]
    rec = comm_report.record(comm_report.local_vector(timing_of(spans, [], 1.0), CommCounter(), 0.0), 1, {"tp": 4})
    assert rec["comm/overlap_tp"] == pytest.approx(1 - 0.12 / 0.4)
    assert rec["comm/tp/exposed_s"] == pytest.approx(0.12)


def test_bubble_is_carved_out_of_the_pipeline_wait() -> None:
    spans = [Span("pp", "send_recv", "blocking", 0.0, 0.3, exposed=True),
             Span("pp", "send_recv", "blocking", 0.5, 0.6, exposed=True)]
    t = timing_of(spans, [("forward", 0.3, 0.5)], 0.6)
    for idle, bubble in ((0.25, 0.25), (0.9, 0.4)):  # the bubble never exceeds the time actually waited
        rec = comm_report.record(comm_report.local_vector(t, CommCounter(), idle), 1, {"pp": 2})
        assert rec["time/bubble_s"] == pytest.approx(bubble)
        assert rec["time/comm_pp_s"] == pytest.approx(0.4 - bubble)
        assert rec["comm/overlap_pp"] == 0.0


class FakeWork:
    """A work without a future (as gloo's p2p works): `wait` blocks `delay_s`, then returns or raises."""

    def __init__(self, delay_s: float, error: Exception | None = None) -> None:
        self.delay_s, self.error, self.waits = delay_s, error, 0

    def get_future(self) -> None:
        raise RuntimeError("Work::getFuture not implemented")

    def wait(self) -> bool:
        self.waits += 1
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return True


def test_watched_works_are_waited_once_and_their_errors_reach_the_owner() -> None:
    timer = CommTimer()
    timer.begin_step(True)
    ok, bad = FakeWork(0.05), FakeWork(0.01, RuntimeError("peer closed"))
    span, watched = timer.launched("pp", "send_recv", ok, timer.mark())
    assert watched
    span.wait(ok, watched)
    assert ok.waits == 1 and span.end is not None  # the watcher's wait only: a gloo send completes once
    bad_span, _ = timer.launched("pp", "send_recv", bad, timer.mark())
    with pytest.raises(RuntimeError, match="peer closed"):
        bad_span.wait(bad, True)
    assert bad.waits == 1
    assert timer.end_step().op_s[("pp", "send_recv")] >= 0.05


class HeldWork(FakeWork):
    """A watched work that completes only once `release` is set (a send whose receiver waits on this rank)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.release = threading.Event()

    def wait(self) -> bool:
        self.waits += 1
        self.release.wait()
        return True


def test_an_owner_waits_on_its_work_itself_while_the_watcher_is_held_by_an_earlier_one() -> None:
    """The watcher waits in launch order; an earlier work that completes only after the owner moves on must
    not hold the owner's wait on a later one (a pipeline send in flight, then a ring hop): the owner claims it."""
    timer = CommTimer()
    timer.begin_step(True)
    held, hop = HeldWork(), FakeWork(0.0)
    timer.launched("pp", "send_recv", held, timer.mark())
    span, watched = timer.launched("cp", "ring", hop, timer.mark())
    owner = threading.Thread(target=span.wait, args=(hop, watched), daemon=True)
    owner.start()
    owner.join(timeout=30)  # a deadlock would never return; the wait itself takes no time
    assert not owner.is_alive() and hop.waits == 1 and span.end is not None
    held.release.set()


def test_a_wait_inside_a_wait_and_other_threads_are_not_exposed_twice() -> None:
    timer = CommTimer()
    timer.begin_step(True)
    with timer.waiting("dp"):
        with timer.collective("dp_intra", "reduce_scatter"):
            time.sleep(0.02)
    worker = threading.Thread(target=lambda: timer.collective("tp", "all_reduce").__enter__())
    worker.start()
    worker.join()
    t = timer.end_step()
    assert t.exposed_s["dp"] >= 0.02 and "dp_intra" not in t.exposed_s and "tp" not in t.exposed_s
    assert t.op_s[("dp_intra", "reduce_scatter")] >= 0.02  # still time in flight for its own op


def test_the_meter_is_its_own_category() -> None:
    spans = [Span("dp", "meter", "blocking", 0.1, 0.3, exposed=True),
             Span("dp", "wait", "wait", 0.8, 0.9, exposed=True)]
    t = timing_of(spans, [("backward", 0.0, 0.5)], 1.0)
    rec = comm_report.record(comm_report.local_vector(t, CommCounter(), 0.0), 1, {"dp": 2})
    assert rec["time/meter_s"] == pytest.approx(0.2)
    assert rec["time/comm_dp_s"] == pytest.approx(0.1)
    assert rec["time/compute_s"] == pytest.approx(0.3)


def test_a_detached_launch_does_not_hold_the_step_open_and_its_landing_wait_is_exposed() -> None:
    """An overlapped outer exchange: launched `detached`, no watcher waits on its work and the step ends without
    it (a timed span would hold `end_step` until a watcher's wait returned); the wait where it lands is exposed
    time, at least the work's own."""
    timer = CommTimer()
    timer.begin_step(True)
    slow = FakeWork(0.05)
    with timer.detached():
        span, watched = timer.launched("dp_inter", "all_reduce", slow, timer.mark())
    t = timer.end_step()
    assert not watched and slow.waits == 0 and ("dp_inter", "all_reduce") not in t.op_s
    timer.begin_step(True)
    with timer.waiting("dp_inter"):
        span.wait(slow, watched)
    assert slow.waits == 1 and timer.end_step().exposed_s["dp_inter"] >= 0.05
