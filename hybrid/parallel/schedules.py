"""Pipeline schedules as data, and a virtual-clock simulator that replays them.

A schedule is a pure function `(pp, microbatches, virtual_stages) → one action list per pipeline
rank`. Nothing here touches a tensor or a process group: the executor in `pipeline.py` runs the
lists with p2p ops, and `simulate` replays the same lists on a virtual clock.

Stages. With `v` virtual stages (model chunks) per rank, the model is cut into S = pp·v parts;
chunk `c` of rank `r` holds part `s = c·pp + r`, so activations go round the ranks v times
(rank pp−1's chunk c feeds rank 0's chunk c+1). Without interleaving v = 1 and s = r.

Actions (`actions.py`): `F`/`B` run a chunk's forward/backward for one microbatch, `SEND_*`/`RECV_*`
move activations and gradients between neighbouring parts. `with_comm` derives the comm actions
from the compute order (receive right before the compute that needs it, send right after the
compute that made it). Consecutive comm actions form one *batch* that the executor posts together
(`batch_isend_irecv`) and waits on before going on — e.g. 1F1B's "send this activation, receive
that gradient". The simulator treats every op as a rendezvous (a batch completes only once every
partner op is posted, in the FIFO order of its (src → dst) channel, which is how NCCL matches p2p
ops); an order that cannot deadlock under that rule cannot deadlock on gloo or NCCL.

The schedules (each rank's compute order; every chunk runs backward in microbatch order, so
gradients accumulate in the same order and losses are bit-identical across schedules):
  gpipe        all forwards, then all backwards: m activations in flight, bubble (p−1)/(m+p−1).
  1f1b         warm-up of p−r−1 forwards, then one forward / one backward, then the remaining
               backwards: at most p−r in flight, the same bubble.
  interleaved  Megatron's interleaved 1F1B over v chunks: warm-up 2(p−r−1) + (v−1)p chunk-forwards,
               then 1F1B over chunk-microbatches; bubble (p−1)/(v·m+p−1). Needs m divisible by p.

`SCHEDULES` is the registry: name → `ScheduleSpec` (the order function and what it needs of the
sizes). A new schedule is one order function `(pp, m, v, rank) → slots` and one entry there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid.parallel.actions import Action, Op, Schedule, ScheduleError, steps

Order = Callable[[int, int, int, int], list[list[Action]]]
"""(pp, microbatches, virtual_stages, rank) → that rank's compute actions, in slots (see `with_comm`)."""


F, B = Op.FORWARD, Op.FULL_BACKWARD  # the two compute ops every schedule here is written in


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


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe_order),
    "1f1b": ScheduleSpec(one_f_one_b_order),
    "interleaved": ScheduleSpec(interleaved_order, virtual=True, check=_interleaved_sizes, min_virtual_stages=2,
                                fewer_virtual="with 1 it is 1f1b with a deeper warm-up: the same bubble, "
                                              "more activation memory"),
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


def with_comm(slots: list[list[Action]], pp: int, v: int, rank: int) -> list[Action]:
    """Insert the p2p actions a compute order needs. Computes are grouped in slots; between two
    slots one exchange sends what the previous slot produced and receives what the next needs."""
    last = pp * v - 1
    out: list[Action] = []
    pending: list[Action] = []  # the previous slot's sends
    for slot in slots:
        recvs = []
        for a in slot:
            part = a.chunk * pp + rank
            if a.op is F and part > 0:
                recvs.append(Action(Op.RECV_F, a.chunk, a.mb))
            elif a.op is B and part < last:
                recvs.append(Action(Op.RECV_B, a.chunk, a.mb))
        out += pending + recvs + slot
        pending = []
        for a in slot:
            part = a.chunk * pp + rank
            if a.op is F and part < last:
                pending.append(Action(Op.SEND_F, a.chunk, a.mb))
            elif a.op is B and part > 0:
                pending.append(Action(Op.SEND_B, a.chunk, a.mb))
    return out + pending


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   forward_only: bool = False) -> Schedule:
    """The action lists of schedule `name`; `forward_only` keeps just the forwards (evaluation)."""
    check_sizes(name, pp, microbatches, virtual_stages)
    v, order = virtual_stages, SCHEDULES[name].order
    lists = []
    for r in range(pp):
        slots = order(pp, microbatches, v, r)
        if forward_only:
            slots = [[a for a in s if a.op is F] for s in slots]
            slots = [s for s in slots if s]
        lists.append(tuple(with_comm(slots, pp, v, r)))
    return Schedule(name, pp, microbatches, v, tuple(lists))


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank runs each (chunk, microbatch) forward once (and its
    backward once, after it), receives before computing, sends after, and every (src → dst)
    channel's sends match its receives one for one, in order."""
    forward_only = not any(a.op is B for acts in schedule.actions for a in acts)
    for r, acts in enumerate(schedule.actions):
        _check_rank(schedule, r, list(acts), forward_only)
    sends: dict[tuple[int, int], list[tuple[int, Action]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Action]]] = defaultdict(list)
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.op.is_send:
                sends[(r, schedule.peer(r, a))].append((r, a))
            elif a.op.is_recv:
                recvs[(schedule.peer(r, a), r)].append((r, a))
    for channel in set(sends) | set(recvs):
        out, inc = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(inc):
            raise ScheduleError(f"channel rank {channel[0]} → rank {channel[1]}: {len(out)} sends but "
                                f"{len(inc)} receives")
        for k, ((sr, s), (rr, rv)) in enumerate(zip(out, inc)):
            step = 1 if s.op.to_next else -1
            want_part = schedule.part(sr, s.chunk) + step
            if rv.op is not s.op.partner or rv.mb != s.mb or schedule.part(rr, rv.chunk) != want_part:
                raise ScheduleError(f"channel rank {sr} → rank {rr}, message {k}: rank {sr} sends {s} but "
                                    f"rank {rr} receives it as {rv}")


def _check_rank(schedule: Schedule, r: int, acts: list[Action], forward_only: bool) -> None:
    p, v, last = schedule.pp, schedule.virtual_stages, schedule.num_parts - 1
    done: set[tuple[Op, int, int]] = set()
    for a in acts:
        key = (a.op, a.chunk, a.mb)
        if key in done or not (0 <= a.chunk < v and 0 <= a.mb < schedule.microbatches):
            raise ScheduleError(f"rank {r}: action {a} is repeated or out of range")
        if a.op.is_compute and a.op not in (F, B):
            raise ScheduleError(f"rank {r}: action {a}: split backward ({Op.BACKWARD_INPUT}/{Op.BACKWARD_WEIGHT}) "
                                "is not validated or simulated yet")
        part = a.chunk * p + r
        needs = {F: Op.RECV_F if part > 0 else None, B: F, Op.SEND_F: F, Op.SEND_B: B}.get(a.op)
        if a.op is B and part < last and (Op.RECV_B, a.chunk, a.mb) not in done:
            raise ScheduleError(f"rank {r}: {a} runs before its gradient is received")
        if needs and (needs, a.chunk, a.mb) not in done:
            raise ScheduleError(f"rank {r}: {a} comes before {Action(needs, a.chunk, a.mb)}")
        done.add(key)
    want = {(F, c, i) for c in range(v) for i in range(schedule.microbatches)}
    if not forward_only:
        want |= {(B, c, i) for c in range(v) for i in range(schedule.microbatches)}
    missing = sorted(want - done)
    if missing:
        raise ScheduleError(f"rank {r}: missing {', '.join(str(Action(*k)) for k in missing[:4])}")


@dataclass
class Simulation:
    """The replay of a schedule: when each compute action ran, and what that means."""

    schedule: Schedule
    makespan: float
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # most (chunk, microbatch) activations held at once, per rank
    intervals: list[tuple[int, float, float, Action]] = field(default_factory=list)  # (rank, start, end, F/B)

    @property
    def bubble_per_rank(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle share of the step, averaged over ranks."""
        per = self.bubble_per_rank
        return sum(per) / len(per)


def simulate(schedule: Schedule, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Simulation:
    """Replay `schedule` on a virtual clock; raise ScheduleError if it is invalid or deadlocks.

    `forward`/`backward` are the costs of one microbatch through a whole rank's layers (a chunk
    costs 1/v of that); `comm` is added to each comm batch. Every p2p op is a rendezvous: a batch
    completes when every op in it has met its partner (see the module docstring).
    """
    validate(schedule)
    p, v = schedule.pp, schedule.virtual_stages
    items = [steps(acts) for acts in schedule.actions]
    keys = [_channel_keys(schedule, r, rank_items) for r, rank_items in enumerate(items)]
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    live, peak = [0] * p, [0] * p
    posted: dict[tuple[str, int, int, int], float] = {}  # (SEND|RECV, src, dst, k) → post time
    sim = Simulation(schedule, 0.0, busy, peak)
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(items[r]):
                it = items[r][pos[r]]
                if isinstance(it, Action):
                    cost = (forward if it.op is F else backward) / v
                    sim.intervals.append((r, clock[r], clock[r] + cost, it))
                    clock[r] += cost
                    busy[r] += cost
                    live[r] += 1 if it.op is F else -1
                    peak[r] = max(peak[r], live[r])
                else:
                    mine = keys[r][pos[r]]
                    for k in mine:
                        posted.setdefault(k, clock[r])
                    partners = [(("RECV" if k[0] == "SEND" else "SEND"),) + k[1:] for k in mine]
                    if any(q not in posted for q in partners):
                        break
                    clock[r] = max([clock[r]] + [posted[q] for q in partners]) + comm
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(items[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at [{', '.join(map(str, items[r][pos[r]]))}]" for r in stuck)
        raise ScheduleError(f"deadlock: {waits}")
    sim.makespan = max(clock)
    return sim


def _channel_keys(schedule: Schedule, r: int, items: list) -> list[list[tuple[str, int, int, int]]]:
    """Per item of rank r, the keys (SEND|RECV, src, dst, k) of its comm ops: the k-th op on the
    src → dst channel, counted along the rank's list (empty for compute actions)."""
    counts: dict[tuple[str, int, int], int] = defaultdict(int)
    out = []
    for it in items:
        batch_keys = []
        for a in it if isinstance(it, list) else []:
            kind = "SEND" if a.op.is_send else "RECV"
            peer = schedule.peer(r, a)
            ch = (kind, r, peer) if kind == "SEND" else (kind, peer, r)
            batch_keys.append(ch + (counts[ch],))
            counts[ch] += 1
        out.append(batch_keys)
    return out
