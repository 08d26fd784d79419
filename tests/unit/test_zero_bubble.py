"""Zero-bubble schedules (zb1p, zbv) and the split backward, without a process group.

References: torch.distributed.pipelining's ScheduleInterleavedZeroBubble (one stage per rank) and
ScheduleZBVZeroBubble compute the same per-rank compute orders; the simulator's makespan of zb1p equals the
zero-bubble paper's cost model, m(F+B+W) + (p−1)(F+B−W), where 1F1B's is m(F+B+W) + (p−1)(F+B+W); and the
split backward (input pass, then weight pass) leaves every gradient bit-identical to one full backward.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from hybrid.config import compose_config
from hybrid.memory import meta_stages, micro_of, rank_memory, training_schedule
from hybrid.model import build_model
from hybrid.parallel.pp.actions import Op, place_of
from hybrid.parallel.pp.schedules import ScheduleError, build_schedule, most_waiting
from hybrid.parallel.pp.simulator import simulate
from hybrid.parallel.pp.split_backward import SavedTensors, backward_input
from hybrid.trainer import build_chunks
from hybrid.validation import validate

IN, WT = Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 7, 8, 16, 24)]


def torch_stages(p: int, parts: list[int], placement: str):
    """Stand-ins for torch's pipeline stages: only what the schedules' constructors read."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    base = getattr(pipelining, "_PipelineStageBase", None)
    if base is None:
        pytest.skip("torch.distributed.pipelining internals changed")
    v = 2 if placement == "v" else 1
    owner = {s: place_of(placement, p, s)[0] for s in range(p * v)}

    class Stage(base):
        def __init__(self, index: int):
            self.stage_index, self.num_stages, self.group_size = index, p * v, p
            self.group_rank, self.stage_index_to_group_rank = owner[index], owner
            self.submod = torch.nn.Identity()

        _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None
        is_first = property(lambda self: self.stage_index == 0)
        is_last = property(lambda self: self.stage_index == self.num_stages - 1)

    return pipelining, [Stage(s) for s in parts]


@pytest.mark.parametrize("name,cls,placement", [("zb1p", "ScheduleInterleavedZeroBubble", "loop"),
                                                ("zbv", "ScheduleZBVZeroBubble", "v")])
def test_orders_match_torch_pipelining(name, cls, placement):
    for p, m in [(2, 2), (2, 3), (2, 4), (3, 6), (4, 2), (4, 4), (4, 6), (4, 7), (4, 8), (4, 12), (8, 24)]:
        v = 2 if placement == "v" else 1
        ours = build_schedule(name, p, m, v)
        for r in range(p):
            pipelining, stages = torch_stages(p, [ours.part(r, c) for c in range(v)], placement)
            try:
                theirs = getattr(pipelining, cls)(stages, m)
            except (TypeError, AttributeError) as e:
                pytest.skip(f"torch.distributed.pipelining internals changed: {e}")
            want = [(Op(a.computation_type.value), a.stage_index, a.microbatch_index)
                    for a in theirs.pipeline_order[r] if a is not None]
            got = [(a.op, ours.part(r, a.chunk), a.mb) for a in ours.actions[r] if a.op.is_compute]
            assert got == want, (name, p, m, r)


@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0),
                                   (1.5, 1.0, 0.25)])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 4), (4, 8), (8, 24)])
def test_zb1p_makespan_is_the_papers_cost_model(p, m, f, i, w):
    """ZB-H1 (W ≤ F and W ≤ B, as in the paper's setting): idle (p−1)(F+B−W) per rank where 1F1B idles (p−1)(F+B+W)."""
    zb = simulate(build_schedule("zb1p", p, m), forward=f, backward=i + w, weight=w)
    plain = simulate(build_schedule("1f1b", p, m), forward=f, backward=i + w, weight=w)
    assert zb.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
    assert plain.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i + w))
    assert zb.busy == pytest.approx(plain.busy)


def test_zb1p_bubble_at_p4_m8_against_the_analytic_figure():
    """The unit-cost case (T_F = T_B = T_W): bubble (p−1)/(3m + p−1) = 3/27 against 1F1B's 9/33."""
    zb, plain = simulate(build_schedule("zb1p", 4, 8), 1.0, 2.0, weight=1.0), simulate(build_schedule("1f1b", 4, 8))
    assert zb.bubble == pytest.approx(3 / 27) and plain.bubble == pytest.approx(9 / 33)
    assert zb.bubble <= plain.bubble / 2


@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_grid_runs_without_deadlock_below_1f1b(p, m):
    plain = simulate(build_schedule("1f1b", p, m), 1.0, 2.0, weight=1.0)
    for name, v in (("zb1p", 1), ("zbv", 2)):
        sim = simulate(build_schedule(name, p, m, v), 1.0, 2.0, weight=1.0)  # raises on a deadlock
        assert sim.busy == pytest.approx([3.0 * m] * p), (name, p, m)
        assert sim.makespan <= plain.makespan + 1e-9, (name, p, m)
        forward_only = simulate(build_schedule(name, p, m, v, forward_only=True))
        assert forward_only.busy == pytest.approx([1.0 * m] * p)


@pytest.mark.parametrize("p,m", GRID)
def test_peak_activations_equal_1f1bs(p, m):
    """A microbatch is held from its F to its W. zb1p holds at most p on any rank (1F1B's rank 0); zbv at most
    2p half-size chunk-activations: the same bytes."""
    plain = max(simulate(build_schedule("1f1b", p, m)).peak_in_flight)
    assert max(simulate(build_schedule("zb1p", p, m)).peak_in_flight) == plain
    assert max(simulate(build_schedule("zbv", p, m, 2)).peak_in_flight) == 2 * plain


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_deferral_between_1f1b_and_zb_h1_runs(p):
    """zb1p with at most d_r weight passes waiting on rank r (0..r, or None: unsplit): every mix runs without
    deadlock, no slower than 1F1B; d = r is ZB-H1 (the default order), d = 0 is 1F1B with each backward's two
    passes back to back, None 1F1B's own order on that rank."""
    for m in (1, 3, 8):
        plain = build_schedule("1f1b", p, m)
        for deferrals in itertools.product(*([None, *range(r + 1)] for r in range(p))):
            sched = build_schedule("zb1p", p, m, deferrals=deferrals)
            assert simulate(sched, 1.0, 2.0, weight=1.0).makespan <= simulate(plain).makespan + 1e-9
        zb_h1 = build_schedule("zb1p", p, m)
        assert build_schedule("zb1p", p, m, deferrals=range(p)).actions == zb_h1.actions
        assert [most_waiting(a) for a in zb_h1.actions] == [min(r, max(m - 1, 0)) for r in range(p)]
        for r in range(p):
            split = [(o, a.mb) for a in plain.actions[r] if a.op.is_compute
                     for o in ((IN, WT) if a.op is Op.FULL_BACKWARD else (a.op,))]
            ours = build_schedule("zb1p", p, m, deferrals=[0] * p).actions[r]
            assert [(a.op, a.mb) for a in ours if a.op.is_compute] == split, (p, m, r)
        assert build_schedule("zb1p", p, m, deferrals=[None] * p).actions == plain.actions


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 6)])
def test_every_zbv_cap_runs_and_keeps_each_chunks_weight_passes_in_order(p, m):
    """zbv capped per rank (0 up to the order's own, or unsplit): no deadlock, every microbatch's passes once, each
    chunk's weight passes in microbatch order (gradients accumulate as uncapped); its own cap is the order.
    At pp4 m=6 the own caps are 0, 1, 3, 4 (40 combinations): ranks with none, small and large caps; m=8's
    0, 3, 5, 6 (168) only adds more values of the same kinds."""
    zbv = build_schedule("zbv", p, m, 2)
    own = [most_waiting(a) for a in zbv.actions]
    assert build_schedule("zbv", p, m, 2, deferrals=own).actions == zbv.actions
    for caps in itertools.product(*([None, *range(k + 1)] for k in own)):
        sched = build_schedule("zbv", p, m, 2, deferrals=caps)
        simulate(sched, 1.0, 2.0, weight=1.0)  # raises on a deadlock
        for r, cap in enumerate(caps):
            computes = [a for a in sched.actions[r] if a.op.is_compute]
            for c in range(2):
                for op in ((Op.FULL_BACKWARD,) if cap is None else (IN, WT)):
                    assert [a.mb for a in computes if a.op is op and a.chunk == c] == list(range(m)), (caps, r)
            assert cap is None or most_waiting(sched.actions[r]) <= cap


@pytest.mark.parametrize("name,deferrals", [("1f1b", [0, 0]), ("interleaved", [0, 0]), ("zb1p", [0]),
                                            ("zb1p", [0, -1])])
def test_deferrals_out_of_range_are_refused(name, deferrals):
    with pytest.raises(ScheduleError, match="deferral"):
        build_schedule(name, 2, 4, 2 if name == "interleaved" else 1, deferrals=deferrals)


FITTED = [("gpt-1b", 2, 4, 1024, 2, 64, "cuda", "zb1p"), ("llama-tiny", 1, 4, 64, 1, 16, "cpu", "zb1p"),
          ("gpt-tiny", 2, 2, 128, 2, 16, "cpu", "zb1p"), ("gpt-125m", 1, 3, 256, 1, 12, "cpu", "zb1p"),
          ("gpt-1b", 2, 4, 1024, 2, 64, "cuda", "zbv"), ("llama-tiny", 1, 2, 64, 1, 16, "cpu", "zbv")]


@pytest.mark.parametrize("model,tp,pp,seq,micro,batch,device,name", FITTED)
def test_fitted_deferrals_stay_within_1f1bs_largest_rank(model, tp, pp, seq, micro, batch, device, name):
    """parallel.zb_memory=1f1b: each rank's estimate within the largest rank's with every backward unsplit (for
    zb1p, 1F1B's: its unsplit order is 1F1B's), and each rank leaves as many weight passes waiting as it can (one
    more, or splitting at all, would cross it; or it is the schedule's own); zb_memory=none is the own order."""
    v = 2 if name == "zbv" else 1
    overrides = [f"model={model}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.schedule={name}",
                 f"parallel.virtual_stages={v}", f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
                 f"train.global_batch_size={batch}"]
    cfg = compose_config(overrides)
    layout = validate(cfg, tp * pp)
    stages = meta_stages(layout, lambda c: build_chunks(cfg, 50257, c))
    m, count = micro_of(cfg, device), batch // micro
    own = [most_waiting(a) for a in build_schedule(name, pp, count, v).actions]

    def totals(deferrals):
        sched = build_schedule(name, pp, count, v, deferrals=deferrals)
        return [rank_memory(cfg, ch, sched, r, 1, m).total for r, ch in enumerate(stages)]

    fitted = training_schedule(cfg, layout, stages, m).deferrals
    limit = max(totals([None] * pp))
    if name == "zb1p":  # unsplit zb1p is 1F1B
        plain = build_schedule("1f1b", pp, count)
        assert limit == max(rank_memory(cfg, ch, plain, r, 1, m).total for r, ch in enumerate(stages))
    for r, (d, total) in enumerate(zip(fitted, totals(fitted))):
        assert total <= limit, (model, name, r, fitted)
        more = [*fitted[:r], 0 if d is None else d + 1, *fitted[r + 1:]]
        assert d == own[r] or totals(more)[r] > limit, (model, name, r, fitted)
    free = training_schedule(compose_config([*overrides, "parallel.zb_memory=none"]), layout, stages, m)
    assert free.actions == build_schedule(name, pp, count, v).actions and not free.deferrals


def test_zbv_beats_zb1p_when_microbatches_fill_the_v():
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p):
            zbv, zb1p = (simulate(build_schedule(n, p, m, v), 1.0, 2.0, weight=1.0)
                         for n, v in (("zbv", 2), ("zb1p", 1)))
            assert zbv.bubble < zb1p.bubble, (p, m)


def test_zbv_turn_is_local_and_streams_are_separate():
    s = build_schedule("zbv", 4, 8, 2)
    comm = [a for a in s.actions[3] if a.op.is_comm]  # rank 3 holds parts 3 and 4: the turn is in memory
    assert not [a for a in comm if a.op is Op.SEND_F and a.chunk == 0]
    assert not [a for a in comm if a.op is Op.RECV_F and a.chunk == 1]
    assert s.streams == ["B+", "B-", "F+", "F-"] and build_schedule("zb1p", 4, 8).streams == ["B-", "F+"]
    assert s.last_rank == 0 and build_schedule("zb1p", 4, 8).last_rank == 3


# ---- the split backward --------------------------------------------------------------------------------------


def chunk(family: str, pre: bool, post: bool) -> torch.nn.Module:
    cfg = compose_config([f"model={family}", "model.n_layers=4", "model.dropout=0.0", "data.seq_len=16",
                          "model.max_seq_len=32", "model.hidden=32", "model.n_heads=4", "model.ffn_hidden=64"])
    layers = range(0, 2) if pre else range(2, 4)
    return build_model(cfg.model, 101, None, layers=layers, pre=pre, post=post, seed=3)


@pytest.mark.parametrize("family", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("pre,post", [(False, True), (False, False), (True, False)])
def test_split_backward_is_bit_identical_to_the_full_backward(family, pre, post):
    torch.manual_seed(0)
    full, split = chunk(family, pre, post), None
    split = copy.deepcopy(full)
    ids, labels = torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16))
    x = ids if pre else torch.randn(2, 16, 32)
    grad = None if post else torch.randn(2, 16, 32)
    counts = {n: 0 for n, _ in split.named_parameters()}
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: counts.__setitem__(n, counts[n] + 1))

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        inp = x if pre else x.clone().requires_grad_(True)
        return model(inp, labels if post else None), (None if pre else inp)

    out, inp = run(full)
    out.backward(grad)
    saved = SavedTensors()
    with saved.hooks():  # as the executor runs a part's forward under a split backward
        out2, inp2 = run(split)
    boxes = list(saved.boxes)
    work = backward_input(out2, grad, inp2, None if pre else saved)
    if not pre:
        assert torch.equal(inp.grad, inp2.grad)
        assert sum(counts.values()) == 0  # the input pass computed no parameter's gradient
        assert work.frontier
        emptied = sum(b[0] is None for b in boxes)
        assert 0 < emptied < len(boxes)  # the input path's saved tensors went; the weight nodes' stay
    work.run()
    assert counts == {n: 1 for n in counts}  # each accumulated once, as under a full backward (DP hooks)
    for (n, p), q in zip(full.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_an_emptied_box_read_again_is_an_error():
    saved = SavedTensors()
    x = torch.randn(4, 4, requires_grad=True)
    with saved.hooks():
        y = (x * x).sum()
    saved.keep_only([])  # nothing kept: a backward that still reads a box must not read freed memory silently
    with pytest.raises(RuntimeError, match="freed after its input pass"):
        y.backward()


def test_a_parameter_used_twice_gets_its_gradient_in_the_input_pass():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    out = lin(torch.tanh(lin(x)))  # the same weight on both sides of a nonlinearity
    work = backward_input(out, torch.ones(4, 8), x)
    assert lin.weight.grad is not None and not work.frontier
    ref = torch.nn.Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    ref(torch.tanh(ref(x2))).backward(torch.ones(4, 8))
    work.run()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(x.grad, x2.grad)


def test_custom_functions_compute_only_what_each_pass_needs():
    """`act_linear` (a custom autograd Function with a weight) under the split: the input pass asks it for the
    input's gradient only, the weight pass for the weight's only (`split_backward.needed`); the gradients equal
    one full backward's."""
    from hybrid.parallel import recompute

    calls: list[tuple[bool, bool]] = []
    original = recompute.needed

    def spy(static, edges):
        out = original(static, edges)
        calls.append(tuple(out))
        return out

    h = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))
    ref_h, ref_w = h.detach().clone().requires_grad_(True), torch.nn.Parameter(w.detach().clone())
    recompute.act_linear(ref_h, ref_w, torch.tanh).sum().backward()
    recompute.needed = spy
    try:
        work = backward_input(recompute.act_linear(h, w, torch.tanh).sum(), None, h)
        work.run()
    finally:
        recompute.needed = original
    assert calls == [(True, False), (False, True)]
    assert torch.equal(h.grad, ref_h.grad) and torch.equal(w.grad, ref_w.grad)
