"""Pipeline schedules as data: a schedule is a pure function `(pp, microbatches, virtual_stages) → one
action list per pipeline rank`. Nothing here touches a tensor or a process group: the executor in
`pipeline.py` runs the lists with p2p ops, and `simulator.py` checks them and replays them on a virtual clock.

Stages. With `v` virtual stages (model chunks) per rank, the model is cut into S = pp·v parts;
chunk `c` of rank `r` holds part `s = c·pp + r`, so activations go round the ranks v times
(rank pp−1's chunk c feeds rank 0's chunk c+1). Without interleaving v = 1 and s = r.

Actions (`actions.py`): `F`/`B` run a chunk's forward/backward for one microbatch; zero-bubble schedules
split the backward into `I` (input gradient: what the previous part waits for) and `W` (weight gradient:
what nobody waits for, so it can fill the bubble; `split_backward.py`). `SEND_*`/`RECV_*` move activations
and gradients between neighbouring parts. `with_comm` derives the comm actions from the compute order
(receive right before the compute that needs it, send right after the compute that made it). Consecutive
comm actions form one *batch* that the executor posts together (`batch_isend_irecv`) and waits on before
going on — e.g. 1F1B's "send this activation, receive that gradient".

The schedules (each rank's compute order; every chunk runs backward in microbatch order, so
gradients accumulate in the same order and losses are bit-identical across schedules):
  gpipe        all forwards, then all backwards: m activations in flight, bubble (p−1)/(m+p−1).
  1f1b         warm-up of p−r−1 forwards, then one forward / one backward, then the remaining
               backwards: at most p−r in flight, the same bubble.
  interleaved  Megatron's interleaved 1F1B over v chunks: warm-up 2(p−r−1) + (v−1)p chunk-forwards,
               then 1F1B over chunk-microbatches; bubble (p−1)/(v·m+p−1). Needs m divisible by p.
  zb1p         ZB-H1 (Qi et al. 2023): 1F1B with the backward split; rank r defers its first r weight
               passes, which then fill the cool-down's waits. Idle time (p−1)(F + I − W) instead of
               1F1B's (p−1)(F + I + W); at most p microbatches in flight on any rank, as 1F1B's rank 0.
               A microbatch waiting for its weight pass holds what that pass reads and the gradients
               it kept, which can outweigh its activations (the last part's logits gradient): the
               trainer defers fewer where that would take a rank past 1F1B's largest (`cap_weight_passes`,
               `memory.weight_deferrals`).

`SCHEDULES` is the registry: name → `ScheduleSpec` (the order function and what it needs of the
sizes). A new schedule is one order function `(pp, m, v, rank) → slots` and one entry there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from hybrid.parallel.pp.actions import Action, Op, Schedule, ScheduleError, steps

__all__ = ["SCHEDULES", "Action", "Op", "Schedule", "ScheduleError", "ScheduleSpec", "build_schedule",
           "cap_weight_passes", "check_sizes", "most_waiting", "steps", "with_comm"]

Order = Callable[[int, int, int, int], list[list[Action]]]
"""(pp, microbatches, virtual_stages, rank) → that rank's compute actions, in slots (see `with_comm`)."""
Deferrals = Optional[Sequence[Optional[int]]]


F, B = Op.FORWARD, Op.FULL_BACKWARD
IN, WT = Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT  # the split backward's input and weight passes


def gpipe_order(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """All forwards, then all backwards (in microbatch order); one action per slot."""
    return [[Action(F, 0, i)] for i in range(m)] + [[Action(B, 0, i)] for i in range(m)]


def one_f_one_b_order(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """Warm-up forwards fill the pipe below this rank; then alternate; then drain. One action per
    slot, so the steady state exchanges "send activation, receive gradient" between F and B."""
    warmup = min(pp - rank - 1, m)
    order = [[Action(F, 0, i)] for i in range(warmup)]
    for i in range(m - warmup):
        order += [[Action(F, 0, warmup + i)], [Action(B, 0, i)]]
    return order + [[Action(B, 0, i)] for i in range(m - warmup, m)]


def interleaved_order(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: the k-th chunk-forward runs chunk (k // pp) % v on microbatch
    (k // (pp·v))·pp + k % pp — groups of pp microbatches go through chunk 0, then chunk 1, … —
    and the k-th chunk-backward the same with chunks in reverse. In the steady state a slot is
    one forward and one backward with a single exchange (both sends, both next receives) after it."""
    total = m * v

    def fwd(k: int) -> Action:
        return Action(F, (k // pp) % v, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        return Action(B, v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp)

    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    order = [[fwd(k)] for k in range(warmup)]
    order += [[fwd(warmup + k), bwd(k)] for k in range(total - warmup)]
    return order + [[bwd(k)] for k in range(total - warmup, total)]


def zb1p_order(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's warm-up, then per microbatch i a forward (while any are left), its input pass, and from
    i = rank on the weight pass of the oldest waiting microbatch; the rank's last `rank` weight passes end it."""
    warmup = min(pp - rank - 1, m)
    order = [[Action(F, 0, i)] for i in range(warmup)]
    weights = iter(range(m))
    for i in range(m):
        order += [[Action(F, 0, warmup + i)]] if warmup + i < m else []
        order += [[Action(IN, 0, i)]] + ([[Action(WT, 0, next(weights))]] if i >= rank else [])
    return order + [[Action(WT, 0, j)] for j in weights]


def zbv_order(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """ZB-V on the V placement (chunk 0 = part r going down, chunk 1 = part 2p−1−r coming back up): chunk-0
    forwards fill the way down, chunk-1 forwards the way up, each chunk-1 input pass is followed at once by
    its weight pass, then a steady state of F I W on both chunks, and a cool-down whose weight passes fill
    the waits. Built for at least 2p−1 microbatches; actions of the microbatches beyond m are dropped."""
    n, done = max(2 * pp - 1, m), {F: [0, 0], IN: [0, 0], WT: [0, 0]}
    seq: list[Action] = []

    def add(*pairs: tuple[Op, int]) -> None:
        for op, c in pairs:
            seq.append(Action(op, c, done[op][c]))
            done[op][c] += 1

    for _ in range(2 * (pp - rank) - 1):
        add((F, 0))
    for _ in range(rank):
        add((F, 1), (F, 0))
    for _ in range(pp - rank):
        add((F, 1), (IN, 1), (WT, 1))
    while done[F][1] < done[F][0] or done[F][0] < n:
        add(*([(F, 0)] if done[F][0] < n else []), (IN, 0), (WT, 0), (F, 1), (IN, 1), (WT, 1))
    for _ in range(rank):
        add((IN, 0), (IN, 1))
    for _ in range(pp - rank):
        add((IN, 0), (WT, 0))
    add(*[(WT, 1)] * (done[IN][1] - done[WT][1]), *[(WT, 0)] * (done[IN][0] - done[WT][0]))
    return [[a] for a in seq if a.mb < m]


def _zbv_sizes(pp: int, m: int, v: int) -> None:
    if pp < 2:
        raise ScheduleError("zbv schedule needs pp >= 2 (its two chunks go down the pipeline ranks and back up)")
    if v != 2:
        raise ScheduleError(f"zbv schedule runs exactly 2 model chunks per rank: set parallel.virtual_stages=2 "
                            f"(got {v})")


def _interleaved_sizes(pp: int, m: int, v: int) -> None:
    if pp < 2:
        raise ScheduleError("interleaved schedule needs pp >= 2 (its chunks go round the pipeline ranks)")
    if m % pp:
        raise ScheduleError(f"interleaved schedule needs microbatches ({m}) divisible by pp={pp}")


def _any_sizes(pp: int, m: int, v: int) -> None:
    """Every pp, microbatches >= 1 will do."""


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: its compute order and what it needs of the sizes."""

    order: Order
    virtual: bool = False  # runs virtual_stages >= 1 model chunks per rank; otherwise exactly one
    check: Callable[[int, int, int], None] = _any_sizes  # (pp, m, v) → raises ScheduleError if it cannot run
    min_virtual_stages: int = 1  # the fewest chunks a training run accepts (the simulator takes any >= 1) …
    fewer_virtual: str = ""  # … and what fewer would amount to, for the config's error line
    placement: str = "loop"  # how the chunks' parts sit on the ranks (`actions.PLACEMENTS`)
    split_backward: bool = False  # runs I and W instead of B (zero-bubble)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe_order),
    "1f1b": ScheduleSpec(one_f_one_b_order),
    "interleaved": ScheduleSpec(interleaved_order, virtual=True, check=_interleaved_sizes, min_virtual_stages=2,
                                fewer_virtual="with 1 it is 1f1b with a deeper warm-up: the same bubble, "
                                              "more activation memory"),
    "zb1p": ScheduleSpec(zb1p_order, split_backward=True),
    "zbv": ScheduleSpec(zbv_order, virtual=True, check=_zbv_sizes, min_virtual_stages=2,
                        fewer_virtual="its V runs two chunks per rank", placement="v", split_backward=True),
}
"""The registry: `parallel.schedule` name → spec; its order is the order of the choices shown."""


def check_sizes(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ScheduleError unless the schedule `name` exists for these sizes."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ScheduleError(f"pp, microbatches and virtual_stages must be >= 1, got {pp}, {microbatches}, "
                            f"{virtual_stages}")
    if not spec.virtual and virtual_stages != 1:
        virtual = " | ".join(n for n, s in SCHEDULES.items() if s.virtual)
        raise ScheduleError(f"virtual_stages={virtual_stages} needs schedule={virtual} (got {name})")
    spec.check(pp, microbatches, virtual_stages)


def with_comm(slots: list[list[Action]], skeleton: Schedule, rank: int) -> list[Action]:
    """Insert the p2p actions a compute order needs (`skeleton`: the schedule's sizes and placement). Computes
    are grouped in slots; between two slots one exchange sends what the previous slot produced and receives
    what the next needs. A neighbouring part on the same rank (the V's turn) needs no comm action."""
    out: list[Action] = []
    pending: list[Action] = []  # the previous slot's sends
    for slot in slots:
        recvs = [Action(op, a.chunk, a.mb) for a in slot for op, step in _comm(a, Op.RECV_F, Op.RECV_B)
                 if _remote(skeleton, rank, a.chunk, step)]
        out += pending + recvs + slot
        pending = [Action(op, a.chunk, a.mb) for a in slot for op, step in _comm(a, Op.SEND_F, Op.SEND_B)
                   if _remote(skeleton, rank, a.chunk, step)]
    return out + pending


def _comm(a: Action, forward_op: Op, backward_op: Op) -> list[tuple[Op, int]]:
    """The comm op of kind receive (RECV_F, RECV_B) or send (SEND_F, SEND_B) compute action `a` needs, with the
    direction (±1) of the part it talks to; [] for W, which exchanges nothing."""
    receive = forward_op is Op.RECV_F
    if a.op is F:
        return [(forward_op, -1 if receive else 1)]
    if a.op in (B, IN):
        return [(backward_op, 1 if receive else -1)]
    return []


def _remote(skeleton: Schedule, rank: int, chunk: int, step: int) -> bool:
    return skeleton.neighbour(rank, chunk, step) is not None and not skeleton.is_local(rank, chunk, step)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   forward_only: bool = False, deferrals: Deferrals = None, comm: bool = True) -> Schedule:
    """The action lists of schedule `name`; `forward_only` keeps just the forwards (evaluation). `deferrals[r]`
    (zb1p, zbv): at most how many weight passes rank r leaves waiting, or None for an unsplit backward
    (`cap_weight_passes`); without them the schedule's own (ZB-H1: r on rank r; `memory.weight_deferrals` fits
    them to memory). `comm=False` leaves out the p2p actions (what the memory estimate replays: cheaper)."""
    check_sizes(name, pp, microbatches, virtual_stages)
    spec, v = SCHEDULES[name], virtual_stages
    _check_deferrals(name, spec, pp, deferrals)
    skeleton = Schedule(name, pp, microbatches, v, (), spec.placement, tuple(deferrals or ()))
    lists = []
    for r in range(pp):
        slots = _order(spec, pp, microbatches, v, r, deferrals)
        if forward_only:
            slots = [[a for a in s if a.op is F] for s in slots]
            slots = [s for s in slots if s]
        lists.append(tuple(with_comm(slots, skeleton, r) if comm else (a for slot in slots for a in slot)))
    return dataclasses.replace(skeleton, actions=tuple(lists))


def _order(spec: ScheduleSpec, pp: int, m: int, v: int, rank: int, deferrals: Deferrals) -> list[list[Action]]:
    slots = spec.order(pp, m, v, rank)
    return cap_weight_passes(slots, deferrals[rank]) if deferrals else slots


def cap_weight_passes(slots: list[list[Action]], cap: Optional[int]) -> list[list[Action]]:
    """A split-backward order with at most `cap` input passes waiting for their weight pass: an input pass that
    would leave more is followed at once by the oldest waiting weight pass (which leaves its later place; per chunk
    the weight passes stay in microbatch order). None: each I and its W become one unsplit backward B at the I's
    place. W exchanges nothing, so the comm order — and the simulator's deadlock proof — is unchanged."""
    flat = [a for slot in slots for a in slot]
    if cap is None:
        return [[Action(B, a.chunk, a.mb) if a.op is IN else a] for a in flat if a.op is not WT]
    out: list[list[Action]] = []
    waiting: list[Action] = []
    for a in flat:
        if a.op is WT and a not in waiting:
            continue  # pulled forward already
        if a.op is WT:
            waiting.remove(a)
        out.append([a])
        if a.op is IN:
            waiting.append(Action(WT, a.chunk, a.mb))
            if len(waiting) > cap:
                out.append([waiting.pop(0)])
    return out


def most_waiting(actions: Sequence[Action]) -> int:
    """The weight passes one rank's order leaves waiting: the least cap (`cap_weight_passes`) that keeps it."""
    computes = [[a] for a in actions if a.op.is_compute]
    waiting = itertools.accumulate(int(a.op is IN) - int(a.op is WT) for a in actions)
    return next(c for c in range(max(waiting, default=0) + 1) if cap_weight_passes(computes, c) == computes)


def _check_deferrals(name: str, spec: ScheduleSpec, pp: int, deferrals: Deferrals) -> None:
    if deferrals is None:
        return
    if not spec.split_backward:
        raise ScheduleError(f"schedule {name} takes no weight-pass deferrals (the zero-bubble schedules do)")
    if len(deferrals) != pp or any(d is not None and d < 0 for d in deferrals):
        raise ScheduleError(f"deferrals {list(deferrals)} must give each of the {pp} ranks a count >= 0 "
                            "(or unsplit)")
