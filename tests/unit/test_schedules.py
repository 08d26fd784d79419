"""Pipeline schedules as data (hybrid/parallel/pp/schedules.py) and the `python -m hybrid.tools.schedule` tool.

No process group: the schedules are pure functions and the simulator a virtual clock. References: the
analytic bubble (p−1)/(v·m+p−1), and torch.distributed.pipelining's own interleaved 1F1B order.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from hybrid.parallel.pp.schedules import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    build_schedule,
    gpipe_order,
    steps,
)
from hybrid.parallel.pp.simulator import simulate, validate
from hybrid.tools import schedule as tool

COSTS = [(1.0, 2.0), (1.0, 1.0), (1.5, 4.0), (2.0, 1.0)]


def analytic(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def valid_sizes(max_p: int = 8, max_m: int = 16, max_v: int = 4):
    """Every (name, p, m, v) of the grid that build_schedule accepts."""
    for name in SCHEDULES:
        for p in range(1, max_p + 1):
            for m in range(1, max_m + 1):
                for v in range(1, max_v + 1):
                    if v > 1 and not SCHEDULES[name].virtual or name == "interleaved" and (p < 2 or m % p) \
                            or name == "zbv" and (p < 2 or v != 2):
                        continue
                    yield name, p, m, v


def with_rank(sched: Schedule, r: int, acts: list[Action]) -> Schedule:
    """`sched` with rank r's action list replaced."""
    lists = list(sched.actions)
    lists[r] = tuple(acts)
    return dataclasses.replace(sched, actions=tuple(lists))


# ---- bubble and memory against the analytic formulas ------------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 7), (4, 3), (4, 8), (8, 16)])
@pytest.mark.parametrize("fwd,bwd", COSTS)
def test_bubble_1f1b_gpipe_is_analytic(name, p, m, fwd, bwd):
    sim = simulate(build_schedule(name, p, m), forward=fwd, backward=bwd)
    assert sim.bubble == pytest.approx(analytic(p, m), abs=1e-12)
    assert sim.bubble_per_rank == pytest.approx([analytic(p, m)] * p, abs=1e-12)
    assert sim.busy == pytest.approx([m * (fwd + bwd)] * p)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 8, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 8, 2)])
@pytest.mark.parametrize("fwd,bwd", COSTS)
def test_bubble_interleaved_is_analytic_and_below_1f1b(p, m, v, fwd, bwd):
    sim = simulate(build_schedule("interleaved", p, m, v), forward=fwd, backward=bwd)
    plain = simulate(build_schedule("1f1b", p, m), forward=fwd, backward=bwd)
    assert sim.bubble == pytest.approx(analytic(p, m, v), abs=1e-12)
    assert sim.bubble < plain.bubble
    assert sim.busy == pytest.approx(plain.busy)  # same work, shorter step


@pytest.mark.parametrize("p,v", [(2, 2), (2, 4), (4, 2), (4, 3)])
def test_interleaved_bubble_shrinks_by_about_v_when_m_much_larger_than_p(p, v):
    m = 8 * p
    ratio = simulate(build_schedule("1f1b", p, m)).bubble / simulate(build_schedule("interleaved", p, m, v)).bubble
    assert ratio == pytest.approx((v * m + p - 1) / (m + p - 1))
    assert 0.9 * v <= ratio <= v


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 5), (4, 2), (4, 8), (8, 16)])
def test_peak_in_flight_1f1b_and_gpipe(p, m):
    assert simulate(build_schedule("1f1b", p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]
    assert simulate(build_schedule("gpipe", p, m)).peak_in_flight == [m] * p


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4), (8, 8, 4)])
def test_peak_in_flight_interleaved(p, m, v):
    peak = simulate(build_schedule("interleaved", p, m, v)).peak_in_flight
    assert all(n <= v * m for n in peak)  # GPipe over v chunks would hold every chunk-activation
    # Megatron's warm-up of 2(p−r−1) + (v−1)p chunk-forwards, plus the steady state's one more
    assert peak == [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]


# ---- every valid size: validates, replays without deadlock, keeps backward order --------------------------------


@pytest.mark.parametrize("forward_only", [False, True])
def test_grid_validates_and_simulates(forward_only):
    """Every schedule at every size up to p=6, m=12, v=4 validates and replays with each rank busy for its work.
    The grid holds every edge the builders branch on (m < p, m = p, m not a multiple of p, one rank, v up to 4);
    larger p and m only repeat the steady phase."""
    count = 0
    for name, p, m, v in valid_sizes(max_p=6, max_m=12):
        sched = build_schedule(name, p, m, v, forward_only=forward_only)
        sim = simulate(sched)  # validates first, then replays; raises ScheduleError on either failure
        work = m * (1.0 if forward_only else 3.0)
        assert sim.busy == pytest.approx([work] * p), (name, p, m, v)
        assert sim.makespan >= work
        count += 1
    assert count > 300


def test_backward_runs_in_microbatch_order_for_every_chunk():
    """What makes losses bit-identical across schedules: each chunk accumulates gradients in mb order (a split
    backward accumulates in both of its passes, so both run in mb order)."""
    split = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
    for name, p, m, v in valid_sizes(max_p=6, max_m=12, max_v=3):
        sched = build_schedule(name, p, m, v)
        for r, acts in enumerate(sched.actions):
            for c in range(v):
                mbs = {op: [a.mb for a in acts if a.op is op and a.chunk == c] for op in Op if op.is_compute}
                assert mbs[Op.FORWARD] == list(range(m)), (name, p, m, v, r, c)
                assert [mbs[Op.FULL_BACKWARD]] + [mbs[op] for op in split] in (
                    [list(range(m)), [], []], [[], list(range(m)), list(range(m))]), (name, p, m, v, r, c)


def test_interleaved_matches_torch_pipelining_order():
    """Reference: torch.distributed.pipelining's ScheduleInterleaved1F1B computes the same per-rank compute order
    (its `pipeline_order` is built without a process group; the stages here are stand-ins)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    try:
        base = pipelining._PipelineStageBase
    except AttributeError as e:
        pytest.skip(f"torch.distributed.pipelining internals changed: {e}")

    class Stage(base):  # only what the schedule's constructor reads
        def __init__(self, index: int, p: int, v: int):
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, p * v, p, index % p
            self.stage_index_to_group_rank = {i: i % p for i in range(p * v)}

        _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None
        is_first = property(lambda self: self.stage_index == 0)
        is_last = property(lambda self: self.stage_index == self.num_stages - 1)

    for p, m, v in [(2, 2, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3)]:
        ours = build_schedule("interleaved", p, m, v)
        for r in range(p):
            try:
                theirs = pipelining.ScheduleInterleaved1F1B([Stage(c * p + r, p, v) for c in range(v)], m)
            except (TypeError, AttributeError) as e:
                pytest.skip(f"torch.distributed.pipelining internals changed: {e}")
            want = [(Op(a.computation_type.value), a.stage_index, a.microbatch_index)
                    for a in theirs.pipeline_order[r] if a is not None]
            got = [(a.op, ours.part(r, a.chunk), a.mb) for a in ours.actions[r] if a.op.is_compute]
            assert got == want, (p, m, v, r)


def test_ops_are_torch_pipelining_computation_types():
    """Op names and values are torch.distributed.pipelining's, so split-backward (I/W) orders read the same."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    theirs = getattr(pipelining, "_ComputationType", None)
    if theirs is None:
        pytest.skip("torch.distributed.pipelining internals changed")
    for op in Op:
        assert theirs[op.name].value == op.value
    assert [f"{op}" for op in Op] == [str(op) for op in Op] == [op.value for op in Op]
    assert str(Action(Op.SEND_B, 1, 3)) == f"{Action('SEND_B', 1, 3)}" == "SEND_B3.c1"
    assert Action("F", 0, 2) == Action(Op.FORWARD, 0, 2) and hash(Action("F", 0, 2)) == hash(Action(Op.FORWARD, 0, 2))


# ---- broken orders ----------------------------------------------------------------------------------------------


def test_swapped_messages_on_one_channel_are_flagged():
    """Rank 1 takes microbatch 1's activation before microbatch 0's: locally valid, but rank 0 sends them the
    other way round and a channel matches its messages in order."""
    sched = build_schedule("gpipe", 2, 3)
    swap = {0: 1, 1: 0, 2: 2}
    acts = [Action(a.op, a.chunk, swap[a.mb]) if a.op in (Op.FORWARD, Op.RECV_F) else a for a in sched.actions[1]]
    with pytest.raises(ScheduleError, match=r"channel rank 0 → rank 1, message 0: rank 0 sends SEND_F0 but rank 1 "
                                            r"receives it as RECV_F1"):
        validate(with_rank(sched, 1, acts))
    with pytest.raises(ScheduleError, match="sends"):
        simulate(with_rank(sched, 1, acts))


def test_gradient_received_after_its_backward_is_flagged():
    sched = build_schedule("1f1b", 2, 2)
    acts = list(sched.actions[0])
    i = acts.index(Action(Op.RECV_B, 0, 0))
    acts.insert(acts.index(Action(Op.FULL_BACKWARD, 0, 0)) + 1, acts.pop(i))
    with pytest.raises(ScheduleError, match="before its gradient is received"):
        simulate(with_rank(sched, 0, acts))


def test_deadlock_is_detected():
    """Rank 0 waits for the gradient of mb 0 before sending mb 0's activation: locally valid, channels matched,
    but rank 1 can't produce that gradient. Only the replay finds it."""
    sched = build_schedule("1f1b", 2, 2)
    acts = list(sched.actions[0])
    acts.remove(Action(Op.RECV_B, 0, 0))
    broken = with_rank(sched, 0, [Action(Op.RECV_B, 0, 0), *acts])
    assert [s for s in steps(broken.actions[0]) if isinstance(s, list)][0] == [Action(Op.RECV_B, 0, 0)]
    validate(broken)
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at .*RECV_B0.*rank 1 waits at .*RECV_F0"):
        simulate(broken)


def test_missing_backward_is_flagged():
    sched = build_schedule("1f1b", 2, 3)
    acts = [a for a in sched.actions[0] if a != Action(Op.FULL_BACKWARD, 0, 2)]
    with pytest.raises(ScheduleError, match="rank 0: missing B2"):
        simulate(with_rank(sched, 0, acts))


def test_duplicated_forward_is_flagged():
    sched = build_schedule("gpipe", 2, 3)
    acts = list(sched.actions[1])
    acts.insert(acts.index(Action(Op.FORWARD, 0, 1)) + 1, Action(Op.FORWARD, 0, 1))
    with pytest.raises(ScheduleError, match="rank 1: action F1 is repeated"):
        simulate(with_rank(sched, 1, acts))


@pytest.mark.parametrize("name,p,m,v,match", [
    ("interleaved", 4, 6, 2, "divisible by pp"),
    ("interleaved", 1, 4, 2, "pp >= 2"),
    ("1f1b", 4, 8, 2, "needs schedule=interleaved"),
    ("gpipe", 2, 4, 3, "needs schedule=interleaved"),
    ("1f1b", 0, 4, 1, ">= 1"),
    ("gpipe", 2, 0, 1, ">= 1"),
    ("1f1b", 2, -3, 1, ">= 1"),
    ("interleaved", 2, 4, 0, ">= 1"),
    ("zero-bubble", 2, 4, 1, "unknown schedule"),
])
def test_invalid_sizes_are_rejected(name, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(name, p, m, v)


def test_registered_schedule_is_built_checked_and_accepted_by_the_config(monkeypatch):
    """A new schedule is one order function and one registry entry: build, checks, config choices and the error
    lines follow the registry."""
    from hybrid.config import ConfigError, compose_config
    from hybrid.validation import validate

    def late_order(pp, m, v, rank):  # every forward, then every backward: GPipe by another name
        return gpipe_order(pp, m, v, rank)

    monkeypatch.setitem(SCHEDULES, "late", ScheduleSpec(late_order))
    assert build_schedule("late", 3, 4).actions == build_schedule("gpipe", 3, 4).actions
    with pytest.raises(ScheduleError, match="unknown schedule 'x'; choose one of gpipe, 1f1b, interleaved, zb1p, zbv, "
                                            "late"):
        build_schedule("x", 2, 2)
    with pytest.raises(ScheduleError, match=r"virtual_stages=2 needs schedule=interleaved \| zbv \(got late\)"):
        build_schedule("late", 2, 4, 2)
    cfg = compose_config(["parallel=pp2", "parallel.schedule=late"])
    assert validate(cfg, 2).pp == 2
    with pytest.raises(ConfigError, match="is not one of gpipe, 1f1b, interleaved, zb1p, zbv, late"):
        validate(compose_config(["parallel.schedule=x"]), 1)


# ---- the tool ---------------------------------------------------------------------------------------------------


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rank ")]


def test_tool_prints_timeline_bubble_and_deadlock_check(capsys):
    assert tool.main(["pp=4", "microbatches=8", "schedule=interleaved", "virtual_stages=2"]) == 0
    out = capsys.readouterr().out
    assert len(rows(out)) == 4
    assert f"bubble: {analytic(4, 8, 2):.4f} simulated" in out and "3/19" in out
    assert "without deadlock" in out and "stream model" in out
    assert "r0 11 (5.5 stages)" in out
    assert tool.main(["pp=4", "m=8", "schedule=interleaved", "v=2"]) == 0  # aliases
    assert capsys.readouterr().out == out


@pytest.mark.parametrize("name,p,m,v,fwd,bwd", [("1f1b", 4, 8, 1, 1.0, 2.0), ("gpipe", 3, 5, 1, 1.0, 3.0),
                                                ("interleaved", 4, 8, 2, 1.0, 2.0), ("interleaved", 2, 4, 3, 2.0, 1.0)])
def test_timeline_cells(name, p, m, v, fwd, bwd):
    sim = simulate(build_schedule(name, p, m, v), forward=fwd, backward=bwd)
    lines = rows(tool.render_timeline(sim))
    assert len(lines) == p
    width = max(len(tool.label(a, v)) for *_, a in sim.intervals)
    cell = min(fwd, bwd) / v
    ncells = round(sim.makespan / cell)
    for r, line in enumerate(lines):
        body = line.split("| ", 1)[1]
        assert all(t.start() % (width + 1) == 0 for t in re.finditer(r"\S+", body))  # columns line up
        cells = [body[i:i + width].strip() for i in range(0, len(body), width + 1)]
        assert len(cells) == ncells
        labels = [c for c in cells if c not in (".", "-" * width)]
        assert len(labels) == 2 * m * v
        assert labels.count(f"F0{'a' if v > 1 else ''}") == 1
        assert len(cells) - cells.count(".") == m * v * (round(fwd / v / cell) + round(bwd / v / cell))
        assert cells.count(".") / ncells == pytest.approx(sim.bubble_per_rank[r])


@pytest.mark.parametrize("argv,match", [
    (["pp=x"], "pp must be an integer"),
    (["microbatches=2.5"], "microbatches must be an integer"),
    (["foo=1"], "unknown key 'foo'"),
    (["pp"], "expected key=value"),
    (["schedule=zigzag"], "unknown schedule 'zigzag'"),
    (["schedule=interleaved", "pp=4", "m=6", "v=2"], "divisible by pp"),
    (["schedule=interleaved", "pp=1", "m=4", "v=2"], "pp >= 2"),
    (["schedule=1f1b", "v=2"], "needs schedule=interleaved"),
    (["pp=0"], ">= 1"),
    (["m=2", "microbatches=3"], "given twice"),
    (["backward=0"], "backward > 0"),
    (["forward_only=maybe"], "forward_only must be true or false"),
    (["schedule=zb1p", "pp=2", "deferrals=0,x"], "deferrals must be comma-separated"),
    (["schedule=1f1b", "pp=2", "deferrals=0,0"], "takes no weight-pass deferrals"),
    (["schedule=zb1p", "pp=4", "deferrals=0,1"], "each of the 4 ranks"),
])
def test_tool_bad_input_is_one_line_and_exit_2(capsys, argv, match):
    assert tool.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("hybrid: error: ") and match in err, err


def test_tool_draws_capped_zero_bubble_orders(capsys):
    """deferrals= draws the order `build_schedule` makes with those caps (as the trainer fits them)."""
    assert tool.main(["pp=4", "m=8", "schedule=zb1p", "deferrals=0,1,1,unsplit", "weight=1"]) == 0
    out = capsys.readouterr().out
    capped = simulate(build_schedule("zb1p", 4, 8, deferrals=[0, 1, 1, None]), 1.0, 2.0, weight=1.0)
    assert "weight passes deferred per rank: 0, 1, 1, unsplit" in out and f"bubble: {capped.bubble:.4f}" in out
    assert "B0" in rows(out)[3] and "W0" not in rows(out)[3]  # the unsplit rank runs whole backwards


def test_tool_forward_only_and_comm(capsys):
    assert tool.main(["pp=2", "m=4", "schedule=gpipe", "forward_only=true", "comm=0.5"]) == 0
    out = capsys.readouterr().out
    assert "B0" not in out and "analytic ignores comm" in out and "without deadlock" in out


def test_tool_writes_png(tmp_path, capsys):
    path = tmp_path / "schedule.png"
    assert tool.main(["pp=4", "m=8", "schedule=interleaved", "v=2", f"png={path}"]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000

