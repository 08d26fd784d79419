"""Pipeline parallelism: stage partitioning, p2p exchange, and the executor that runs a schedule.

The model is cut into pp·v parts (`partition_layers`); rank r of the pipeline holds parts
r, r+pp, … (one model chunk each, see `schedules.py`). The first part also holds the
embedding, the last the final norm, head and loss. Each TP rank of a stage exchanges with the
same TP rank of the neighbouring stage over the PP group: its whole [b, s, h] hidden state, or
its [b, s/tp, h] sequence chunk under sequence parallelism.

`run_schedule` walks this rank's action list. A compute action calls the `forward_step` it is
handed (the trainer owns the data, the model call and autocast) or runs a backward — whole (B), or split
into the input pass (I) and the weight pass (W) of `split_backward.py`; a batch of consecutive comm actions
becomes one `batch_isend_irecv` whose receives are waited on before going on, its sends completing in the
background (the stream model the simulator proves deadlock-free). The loss exists only on the last part;
its backward is scaled by 1/microbatches so gradients sum to the global-batch mean. After an
activation is sent its storage is freed at once (Megatron's trick: the tensor keeps its autograd
node, its data becomes one element) and its backward is run through the autograd engine directly,
which does not check the freed shape. DP gradient sync is not called here: `GradSync` launches
each bucket itself once its gradients are final, whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.parallel.clocks import Clock, HostClock, Mark, Span
from hybrid.parallel.collectives import Group
from hybrid.parallel.pp.actions import Action, Op, Schedule, steps
from hybrid.parallel.pp.simulator import simulate
from hybrid.parallel.pp.split_backward import SavedTensors, WeightGrads, backward_input, run_backward

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]
"""(chunk, microbatch, received hidden states or None on the first part) → hidden states, or the
microbatch's mean loss on the last part."""


def partition_layers(n_layers: int, parts: int, stage_layers: Optional[Sequence[int]] = None) -> list[range]:
    """Global layer indices of each model part. Balanced by default: every part gets
    n_layers // parts, and the first n_layers % parts get one more. `stage_layers` sets the counts
    explicitly (the first and last part may be empty: embedding-only or head-only)."""
    if isinstance(stage_layers, str):  # `auto` is a split still to be made: hybrid.plan.balance.resolve makes it
        raise ValueError(f"parallel.stage_layers={stage_layers} must be resolved into layer counts before the model "
                         "is built (hybrid.plan.balance.resolve)")
    if stage_layers is None:
        base, extra = divmod(n_layers, parts)
        counts = [base + (i < extra) for i in range(parts)]
    else:
        counts = list(stage_layers)
        if len(counts) != parts or sum(counts) != n_layers or min(counts) < 0:
            raise ValueError(f"parallel.stage_layers={counts} must list {parts} layer counts (pp·virtual_stages) "
                             f"summing to model.n_layers={n_layers}")
        if any(c < 1 for c in counts[1:-1]):
            raise ValueError(f"parallel.stage_layers={counts}: only the first and last part may be empty")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


class P2P:
    """Batched sends and receives with the neighbouring pipeline ranks (over `group`).

    Received hidden states and gradients all have `shape` and `dtype` (the residual stream's).
    Sent bytes are counted as ops `send_fwd` / `send_bwd` of the group. Each comm stream of the schedule
    (`Schedule.stream`: activations or gradients, down or up) goes over its own group of `streams` (the
    same ranks; `group` for a stream not given), so that NCCL, which runs one group's ops in order, runs
    them in the order the simulator proved deadlock-free; a batch posts one `batch_isend_irecv` per stream.
    A batch waits for its receives only: where the backend hands back one work per op (gloo), the sends
    complete in the background while the rank computes on and `drain()` waits for them at the end of the
    schedule; where it coalesces a stream's ops into one work (NCCL), that work is waited on if it
    receives anything (the host does not block there) and drained with the sends otherwise.
    Under `C.TIMER`, posting plus the receives' wait is a blocking `send_recv` span, each background
    send an async `send_recv` span, and `drain()`'s wait exposed time of the group.
    """

    def __init__(self, group: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 streams: Optional[dict[str, Group]] = None) -> None:
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        self.streams = streams or {}
        self.name = C.group_name(group)
        self.sending: list[tuple[dist.Work, object, Span, bool]] = []  # in flight (tensors kept alive)

    def exchange(self, schedule: Schedule, rank: int, batch: list[Action],
                 tensors: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Post every op of `batch` at once (one `batch_isend_irecv` per stream), then wait for the receives;
        return the received tensors."""
        with C.TIMER.collective(self.name, "send_recv"):
            received: dict[Action, torch.Tensor] = {}
            waits = []
            for stream in sorted({schedule.stream(rank, a) for a in batch}):
                ops = [a for a in batch if schedule.stream(rank, a) == stream]
                waits += self._post(schedule, rank, ops, tensors, self.streams.get(stream, self.group), received)
            for work in waits:
                work.wait()
            return received

    def _post(self, schedule: Schedule, rank: int, batch: list[Action], tensors: dict[Action, torch.Tensor],
              group: Group, received: dict[Action, torch.Tensor]) -> list[dist.Work]:
        """Post one stream's ops; keep its sends in flight; return the works to wait for (its receives)."""
        ops = [self._op(schedule, rank, a, tensors, group, received) for a in batch]
        start = C.TIMER.mark()
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one coalesced work (NCCL): waited on if it receives, else drained
            if any(op.op is dist.irecv for op in ops):
                return works[:1]
            self.sending.append((works[0], [op.tensor for op in ops], *C.TIMER.launched(
                self.name, "send_recv", works[0], start)))
            return []
        for op, work in zip(ops, works):
            if op.op is dist.isend:
                self.sending.append((work, op.tensor, *C.TIMER.launched(self.name, "send_recv", work, start)))
        return [w for op, w in zip(ops, works) if op.op is dist.irecv]

    def _op(self, schedule: Schedule, rank: int, a: Action, tensors: dict[Action, torch.Tensor], group: Group,
            received: dict[Action, torch.Tensor]) -> dist.P2POp:
        peer = schedule.peer(rank, a)
        if a.op.is_send:
            t = tensors[a].detach().contiguous()
            if t.shape != self.shape or t.dtype != self.dtype:
                raise RuntimeError(f"pipeline {a}: sending {tuple(t.shape)} {t.dtype}, but every stage "
                                   f"receives {self.shape} {self.dtype}")
            C.COUNTER.record(self.name, "send_fwd" if a.op is Op.SEND_F else "send_bwd", t, schedule.pp)
            return dist.P2POp(dist.isend, t, group=group, group_peer=peer)
        received[a] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return dist.P2POp(dist.irecv, received[a], group=group, group_peer=peer)

    def drain(self) -> None:
        """Wait for the sends still in flight (the end of a schedule)."""
        if self.sending:
            with C.TIMER.waiting(self.name, "send_recv"):
                for work, _, span, watched in self.sending:
                    span.wait(work, watched)
        self.sending = []


@dataclass
class PipelineStats:
    """This rank's compute per action kind — `forward`, `backward` (B, or a split backward's input pass I),
    `weight` (its weight pass W) — as (kind, start, end) marks of `clock` (CUDA events on CUDA, so the
    times are the device's), read as seconds after the step."""

    clock: Clock = field(default_factory=HostClock)
    marks: list[tuple[str, Mark, Mark]] = field(default_factory=list)

    def seconds(self, kind: str) -> list[float]:
        return [self.clock.seconds(a, b) for k, a, b in self.marks if k == kind]

    @property
    def forward_s(self) -> list[float]:
        return self.seconds("forward")

    @property
    def backward_s(self) -> list[float]:
        return self.seconds("backward")

    @property
    def weight_s(self) -> list[float]:
        return self.seconds("weight")

    @property
    def busy_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s) + sum(self.weight_s)


def schedule_idle_s(schedule: Schedule, rank: int, forward_s: float, backward_s: float,
                    weight_s: Optional[float] = None) -> float:
    """The seconds pipeline rank `rank` idles because of the schedule itself: the simulator's replay with
    `forward_s` / `backward_s` (the whole backward; `weight_s` of it in the weight pass under a split
    backward) per microbatch through a rank (this rank's measured means) and free p2p."""
    if schedule.pp == 1 or forward_s + backward_s <= 0:
        return 0.0
    sim = simulate(schedule, forward=forward_s, backward=backward_s, weight=weight_s)
    return sim.makespan - sim.busy[rank]


class _Run:
    """The state of one rank walking one schedule: inputs kept for backward, outputs in flight."""

    def __init__(self, schedule: Schedule, rank: int, forward_step: ForwardStep, p2p: Optional[P2P],
                 stats: PipelineStats) -> None:
        self.schedule, self.rank, self.forward_step, self.p2p, self.stats = schedule, rank, forward_step, p2p, stats
        self.inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[Action, torch.Tensor] = {}
        self.weights: dict[tuple[int, int], WeightGrads] = {}  # split backward: input pass done, weight pass due
        self.split = any(a.op is Op.BACKWARD_INPUT for a in schedule.actions[rank])
        self.saved: dict[tuple[int, int], SavedTensors] = {}  # split backward: what the forward saved, boxed
        self.losses: list[torch.Tensor] = []
        self.last_part = schedule.num_parts - 1

    def forward(self, a: Action) -> None:
        x = self.received.pop(Action(Op.RECV_F, a.chunk, a.mb), None)
        if x is None and self.schedule.is_local(self.rank, a.chunk, -1):  # the V's turn: in memory
            x = self.outputs[(self.schedule.neighbour(self.rank, a.chunk, -1)[1], a.mb)].detach()
        if x is not None and torch.is_grad_enabled():
            x.requires_grad_(True)
        start = self.stats.clock.mark()
        if self.split and x is not None and torch.is_grad_enabled():  # the input pass will empty some boxes
            self.saved[(a.chunk, a.mb)] = SavedTensors()
            with self.saved[(a.chunk, a.mb)].hooks():
                out = self.forward_step(a.chunk, a.mb, x)
        else:
            out = self.forward_step(a.chunk, a.mb, x)
        self.stats.marks.append(("forward", start, self.stats.clock.mark()))
        if self.schedule.part(self.rank, a.chunk) == self.last_part:
            self.losses.append(out.detach())
        if out.requires_grad:
            self.inputs[(a.chunk, a.mb)] = x
        self.outputs[(a.chunk, a.mb)] = out

    def backward(self, a: Action) -> None:
        """B, or I: from the loss scaled by 1/m on the last part, from the received gradient elsewhere."""
        out = self.outputs.pop((a.chunk, a.mb))
        start = self.stats.clock.mark()
        if self.schedule.part(self.rank, a.chunk) == self.last_part:
            root, grad = out / self.schedule.microbatches, None
        elif self.schedule.is_local(self.rank, a.chunk, 1):  # the V's turn: the next chunk's input gradient
            root, grad = out, self.inputs.pop((self.schedule.neighbour(self.rank, a.chunk, 1)[1], a.mb)).grad
        else:
            root, grad = out, self.received.pop(Action(Op.RECV_B, a.chunk, a.mb))
        if a.op is Op.BACKWARD_INPUT:
            self.weights[(a.chunk, a.mb)] = backward_input(root, grad, self.inputs.get((a.chunk, a.mb)),
                                                           self.saved.pop((a.chunk, a.mb), None))
        else:  # `out` may have been freed after its send: no shape check (Megatron does the same)
            run_backward((root,), (grad if grad is not None else torch.ones_like(root),))
        self.stats.marks.append(("backward", start, self.stats.clock.mark()))

    def backward_weight(self, a: Action) -> None:
        start = self.stats.clock.mark()
        self.weights.pop((a.chunk, a.mb)).run()
        self.stats.marks.append(("weight", start, self.stats.clock.mark()))

    def exchange(self, batch: list[Action]) -> None:
        tensors = {}
        for a in batch:
            if a.op is Op.SEND_F:
                tensors[a] = self.outputs[(a.chunk, a.mb)]
            elif a.op is Op.SEND_B:
                tensors[a] = self.inputs.pop((a.chunk, a.mb)).grad
        self.received.update(self.p2p.exchange(self.schedule, self.rank, batch, tensors))
        for a in batch:
            if a.op is Op.SEND_F:
                self._free(a)

    def _free(self, a: Action) -> None:
        """The activation has been sent: keep its autograd node for the backward, drop its data."""
        out = self.outputs[(a.chunk, a.mb)]
        if out.grad_fn is None:
            del self.outputs[(a.chunk, a.mb)]  # forward-only: nothing to keep
        else:
            out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def run_schedule(schedule: Schedule, rank: int, forward_step: ForwardStep, p2p: Optional[P2P] = None,
                 stats: Optional[PipelineStats] = None) -> list[torch.Tensor]:
    """Run pipeline rank `rank`'s actions of `schedule`; return the last part's per-microbatch
    losses in microbatch order (an empty list on other ranks). A schedule with no backward
    actions (`forward_only`) runs evaluation; call it under `torch.no_grad()`."""
    run = _Run(schedule, rank, forward_step, p2p, stats if stats is not None else PipelineStats())
    for item in steps(schedule.actions[rank]):
        if isinstance(item, list):
            run.exchange(item)
        elif item.op is Op.FORWARD:
            run.forward(item)
        elif item.op is Op.BACKWARD_WEIGHT:
            run.backward_weight(item)
        else:
            run.backward(item)
    if p2p is not None:
        p2p.drain()
    if run.received or run.weights or any(o.grad_fn is not None for o in run.outputs.values()):
        raise RuntimeError(f"pipeline rank {rank}: schedule {schedule.name} left tensors unused")
    return run.losses

