"""Checking and replaying schedules: `validate` proves an action list well formed, `simulate` runs it on a
virtual clock (makespan, idle share per rank, activations in flight) and proves it deadlock-free.

The simulator treats every p2p op as a rendezvous: a batch of comm actions completes only once every
partner op is posted, in the FIFO order of its (src → dst) channel, which is how NCCL matches p2p ops;
an order that cannot deadlock under that rule cannot deadlock on gloo or NCCL.

Costs: `forward` and `backward` are one microbatch through a whole rank's layers (a chunk costs 1/v of
that). A split backward costs the same in total: `I` (input gradient) `backward − weight`, `W` (weight
gradient) `weight`, half of the backward by default (the zero-bubble paper's T_B = T_W). A microbatch's
activations are in flight from its F to its B, or to its W under a split backward (the input pass keeps
the graph for the weight pass). `parts` instead gives each model part its own (forward, backward) seconds of one
microbatch (stages of unequal cost: the embedding's, the head's, an uneven `parallel.stage_layers`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from hybrid.parallel.pp.actions import Action, Op, Schedule, ScheduleError, part_of, steps

F, B = Op.FORWARD, Op.FULL_BACKWARD
IN, WT = Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT  # the split backward's input and weight passes
RELEASES = (B, WT)  # the compute ops after which a microbatch's activations are freed


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank runs each (chunk, microbatch) forward once and its backward
    once after it (B, or I then W), receives before computing, sends after, and every (src → dst) channel
    of each comm stream (activations, gradients) has its sends match its receives one for one, in order."""
    forward_only = not any(a.op is not F for acts in schedule.actions for a in acts if a.op.is_compute)
    for r, acts in enumerate(schedule.actions):
        _check_rank(schedule, r, list(acts), forward_only)
    sends: dict[tuple[int, int, str], list[tuple[int, Action]]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[tuple[int, Action]]] = defaultdict(list)
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.op.is_send:
                sends[(r, schedule.peer(r, a), schedule.stream(r, a))].append((r, a))
            elif a.op.is_recv:
                recvs[(schedule.peer(r, a), r, schedule.stream(r, a))].append((r, a))
    for channel in set(sends) | set(recvs):
        _check_channel(schedule, channel, sends.get(channel, []), recvs.get(channel, []))


def _check_channel(schedule: Schedule, channel: tuple[int, int, str], out: list, inc: list) -> None:
    if len(out) != len(inc):
        raise ScheduleError(f"channel rank {channel[0]} → rank {channel[1]}: {len(out)} sends but "
                            f"{len(inc)} receives")
    for k, ((sr, s), (rr, rv)) in enumerate(zip(out, inc)):
        step = 1 if s.op.to_next else -1
        want_part = schedule.part(sr, s.chunk) + step
        if rv.op is not s.op.partner or rv.mb != s.mb or schedule.part(rr, rv.chunk) != want_part:
            raise ScheduleError(f"channel rank {sr} → rank {rr}, message {k}: rank {sr} sends {s} but "
                                f"rank {rr} receives it as {rv}")


def _needs(schedule: Schedule, r: int, a: Action) -> list[tuple[Op, int, tuple[Op, ...]]]:
    """What must have run on rank r before `a`: per entry (label, chunk, ops), one of `ops` on that chunk and
    the same microbatch. A neighbouring part on this rank hands over in memory: its compute instead of a receive."""
    if a.op is F:
        return _from(schedule, r, a.chunk, -1, Op.RECV_F, (F,))
    if a.op in (B, IN):
        return [(F, a.chunk, (F,))] + _from(schedule, r, a.chunk, 1, Op.RECV_B, (B, IN))
    return {WT: [(IN, a.chunk, (IN,))], Op.SEND_F: [(F, a.chunk, (F,))],
            Op.SEND_B: [(B, a.chunk, (B, IN))]}.get(a.op, [])


def _from(schedule: Schedule, r: int, chunk: int, step: int, recv: Op, local_ops: tuple[Op, ...]) -> list:
    other = schedule.neighbour(r, chunk, step)
    if other is None:
        return []
    return [(local_ops[0], other[1], local_ops)] if other[0] == r else [(recv, chunk, (recv,))]


def _check_rank(schedule: Schedule, r: int, acts: list[Action], forward_only: bool) -> None:
    done: set[tuple[Op, int, int]] = set()
    for a in acts:
        key = (a.op, a.chunk, a.mb)
        if key in done or not (0 <= a.chunk < schedule.virtual_stages and 0 <= a.mb < schedule.microbatches):
            raise ScheduleError(f"rank {r}: action {a} is repeated or out of range")
        if a.op in (B, IN) and ({(B, a.chunk, a.mb), (IN, a.chunk, a.mb)} & done):
            raise ScheduleError(f"rank {r}: {a}: microbatch {a.mb} of chunk {a.chunk} already ran its backward")
        for label, chunk, options in _needs(schedule, r, a):
            if not any((op, chunk, a.mb) in done for op in options):
                late = "its gradient is received" if label is Op.RECV_B else Action(label, chunk, a.mb)
                raise ScheduleError(f"rank {r}: {a} runs before {late}")
        done.add(key)
    missing = [Action(op, c, i) for c in range(schedule.virtual_stages) for i in range(schedule.microbatches)
               for op in _wanted(done, c, i, forward_only) if (op, c, i) not in done]
    if missing:
        raise ScheduleError(f"rank {r}: missing {', '.join(map(str, missing[:4]))}")


def _wanted(done: set[tuple[Op, int, int]], c: int, i: int, forward_only: bool) -> tuple[Op, ...]:
    """The compute ops (chunk c, microbatch i) must have: F, and B or the split pair I, W."""
    if forward_only:
        return (F,)
    return (F, IN, WT) if {(IN, c, i), (WT, c, i)} & done else (F, B)


@dataclass
class Simulation:
    """The replay of a schedule: when each compute action ran, and what that means."""

    schedule: Schedule
    makespan: float
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # most (chunk, microbatch) activations held at once, per rank
    intervals: list[tuple[int, float, float, Action]] = field(default_factory=list)  # (rank, start, end, compute)

    @property
    def bubble_per_rank(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle share of the step, averaged over ranks."""
        per = self.bubble_per_rank
        return sum(per) / len(per)


def costs(schedule: Schedule, forward: float, backward: float, weight: Optional[float]) -> dict[Op, float]:
    """Seconds of one chunk-microbatch per compute op (see the module docstring)."""
    v, w = schedule.virtual_stages, backward / 2 if weight is None else weight
    if not 0 <= w <= backward:
        raise ScheduleError(f"weight-gradient cost {w} must lie in [0, backward={backward}]")
    return {F: forward / v, B: backward / v, IN: (backward - w) / v, WT: w / v}


def part_costs(schedule: Schedule, parts: Sequence[tuple[float, float]], weight_share: float
               ) -> list[list[dict[Op, float]]]:
    """Seconds per compute op of each rank's chunks when every model part has its own (forward, backward); a split
    backward's weight pass takes `weight_share` of the part's backward."""
    if len(parts) != schedule.pp * schedule.virtual_stages:
        raise ScheduleError(f"{len(parts)} part costs for {schedule.pp * schedule.virtual_stages} model parts")
    table = []
    for r in range(schedule.pp):
        fb = [parts[part_of(schedule.placement, schedule.pp, r, c)] for c in range(schedule.virtual_stages)]
        table.append([{F: f, B: b, IN: b * (1 - weight_share), WT: b * weight_share} for f, b in fb])
    return table


def simulate(schedule: Schedule, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0,
             weight: Optional[float] = None, parts: Optional[Sequence[tuple[float, float]]] = None) -> Simulation:
    """Replay `schedule` on a virtual clock; raise ScheduleError if it is invalid or deadlocks.

    Costs as in the module docstring (`parts`: per model part, a weight pass the same share of each part's backward
    as `weight` of `backward`); `comm` is the time of one comm batch once its ops are matched.
    """
    wiring = _wired(schedule)
    one = costs(schedule, forward, backward, weight)
    share = one[WT] / one[B] if one[B] else 0.5
    table = part_costs(schedule, parts, share) if parts is not None else [[one] * schedule.virtual_stages] * schedule.pp
    items = wiring.items
    comms = _Comms(wiring, comm)
    p = schedule.pp
    pos, clock, busy, live, peak = [0] * p, [0.0] * p, [0.0] * p, [0] * p, [0] * p
    sim = Simulation(schedule, 0.0, busy, peak)
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(items[r]):
                it = items[r][pos[r]]
                if isinstance(it, Action):
                    cost = table[r][it.chunk][it.op]
                    sim.intervals.append((r, clock[r], clock[r] + cost, it))
                    clock[r] += cost
                    busy[r] += cost
                    live[r] += 1 if it.op is F else -(it.op in RELEASES)
                    peak[r] = max(peak[r], live[r])
                elif not comms.reach(r, clock):
                    break
                pos[r] += 1
                progress = True
    _raise_if_stuck(items, pos, comms)
    sim.makespan = max(clock + [t or 0.0 for t in comms.all_done()])
    return sim


def _raise_if_stuck(items: list[list], pos: list[int], comms: _Comms) -> None:
    stuck = [r for r in range(len(items)) if pos[r] < len(items[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at [{', '.join(map(str, items[r][pos[r]]))}]" for r in stuck)
        raise ScheduleError(f"deadlock: {waits}")
    unmatched = [ref for ref, t in zip(comms.posted, comms.all_done()) if t is None]
    if unmatched:
        r, stream, j = unmatched[0]
        raise ScheduleError(f"deadlock: rank {r}'s comm batch {j} on stream {stream} never completes")


@dataclass(frozen=True)
class _Wiring:
    """What a replay needs of a schedule whatever its costs: each rank's steps, its comm batches split per stream
    (`refs`: rank → batch → its sub-batches (stream, index)), each sub-batch's partners."""

    items: list[list]
    refs: list[list[list[tuple[str, int]]]]
    partners: dict[tuple[int, str, int], list[tuple[int, str, int]]]
    receives: frozenset[tuple[int, str, int]]  # the sub-batches with a receive in them


@functools.lru_cache(maxsize=16)
def _wired(schedule: Schedule) -> _Wiring:
    """`schedule` checked (`validate`) and wired, once per schedule: the planner replays one at many costs."""
    validate(schedule)
    items = [steps(acts) for acts in schedule.actions]
    subs: dict[tuple[int, str], list[list[Action]]] = defaultdict(list)
    refs = [[_split(schedule, r, batch, subs) for batch in rank_items if isinstance(batch, list)]
            for r, rank_items in enumerate(items)]
    receives = frozenset((r, stream, j) for (r, stream), rank_subs in subs.items()
                         for j, sub in enumerate(rank_subs) if any(a.op.is_recv for a in sub))
    return _Wiring(items, refs, _match(schedule, subs), receives)


def _split(schedule: Schedule, r: int, batch: list[Action], subs: dict[tuple[int, str], list[list[Action]]]
           ) -> list[tuple[str, int]]:
    """Rank r's comm batch as one sub-batch per stream, appended to `subs`; their (stream, index) refs."""
    refs = []
    for stream in sorted({schedule.stream(r, a) for a in batch}):
        refs.append((stream, len(subs[(r, stream)])))
        subs[(r, stream)].append([a for a in batch if schedule.stream(r, a) == stream])
    return refs


def _match(schedule: Schedule, subs: dict[tuple[int, str], list[list[Action]]]
           ) -> dict[tuple[int, str, int], list[tuple[int, str, int]]]:
    """(rank, stream, sub-batch) → the (rank, stream, sub-batch) of each of its ops' partner op."""
    keys_of = {(r, stream, j): keys for (r, stream), rank_subs in subs.items()
               for j, keys in enumerate(_channel_keys(schedule, r, rank_subs))}
    where = {key: ref for ref, keys in keys_of.items() for key in keys}
    return {ref: [where[_partner_key(key)] for key in keys] for ref, keys in keys_of.items()}


class _Comms:
    """The comm batches of every rank as the executor runs them. A batch is one sub-batch per comm stream it
    uses (activations F, gradients B: each its own process group, so its own NCCL stream). Rank r's k-th
    sub-batch on a stream is posted when the rank reaches the batch, starts once posted and once its
    (k−1)-th has completed (NCCL runs a communicator's groups in order), and completes `comm` after every op
    in it has met its partner op (the j-th op of the same src → dst channel and stream) started on the
    partner's stream. The rank waits for a batch only if it receives something; sends complete in the
    background (the executor drains them at the end)."""

    def __init__(self, wiring: _Wiring, comm: float) -> None:
        self.comm = comm
        self.refs, self.partners, self.receives = wiring.refs, wiring.partners, wiring.receives
        self.posted: dict[tuple[int, str, int], float] = {}
        self._done: dict[tuple[int, str, int], float] = {}
        self._busy: set[tuple[int, str, int]] = set()
        self.reached = [0] * len(wiring.items)  # batches each rank has gone past

    def all_done(self) -> list[Optional[float]]:
        return [self.done(*ref) for ref in self.posted]

    def reach(self, r: int, clock: list[float]) -> bool:
        """Rank r reaches its next batch: post its sub-batches at its clock (once); True when the rank may go on
        (the batch's receives, if any, have completed: the clock then moves to that completion)."""
        refs = [(r, stream, j) for stream, j in self.refs[r][self.reached[r]]]
        for ref in refs:
            self.posted.setdefault(ref, clock[r])
        waits = [self.done(*ref) for ref in refs if ref in self.receives]
        if any(t is None for t in waits):
            return False
        clock[r] = max([clock[r], *waits])
        self.reached[r] += 1
        return True

    def start(self, r: int, stream: str, j: int) -> Optional[float]:
        if (r, stream, j) not in self.posted:
            return None
        before = self.done(r, stream, j - 1) if j else 0.0
        return None if before is None else max(self.posted[(r, stream, j)], before)

    def done(self, r: int, stream: str, j: int) -> Optional[float]:
        """When rank r's j-th sub-batch on `stream` completes, or None while that is not determined yet."""
        ref = (r, stream, j)
        if ref in self._done:
            return self._done[ref]
        if ref in self._busy:
            return None  # a cycle of waits: not (yet) resolvable
        self._busy.add(ref)
        try:
            times = [self.start(*ref)] + [self.start(*q) for q in self.partners[ref]]
        finally:
            self._busy.discard(ref)
        if any(t is None for t in times):
            return None
        self._done[ref] = max(times) + self.comm
        return self._done[ref]


def _partner_key(key: tuple[str, str, int, int, int]) -> tuple[str, str, int, int, int]:
    return ("RECV" if key[0] == "SEND" else "SEND",) + key[1:]


def _channel_keys(schedule: Schedule, r: int, items: list) -> list[list[tuple[str, str, int, int, int]]]:
    """Per item of rank r, the keys (SEND|RECV, stream, src, dst, k) of its comm ops: the k-th op on the
    src → dst channel of that stream, counted along the rank's list (empty for compute actions)."""
    counts: dict[tuple[str, str, int, int], int] = defaultdict(int)
    out = []
    for it in items:
        batch_keys = []
        for a in it if isinstance(it, list) else []:
            kind = "SEND" if a.op.is_send else "RECV"
            peer = schedule.peer(r, a)
            stream = schedule.stream(r, a)
            ch = (kind, stream, r, peer) if kind == "SEND" else (kind, stream, peer, r)
            batch_keys.append(ch + (counts[ch],))
            counts[ch] += 1
        out.append(batch_keys)
    return out
