"""The vocabulary of pipeline schedules: ops, actions, a schedule's action lists, and their batches.

An `Action` is one op of one rank on (model chunk, microbatch). `F`/`B` run a chunk's forward/full
backward; `SEND_F`/`RECV_F` move an activation to/from the next model part, `SEND_B`/`RECV_B` its
gradient to/from the previous part. The op names are `torch.distributed.pipelining`'s computation
types (`_ComputationType`), including the split backward's `I` (input gradient) and `W` (weight
gradient), so orders written in its notation read the same here. Consecutive comm actions form
one *batch* (`steps`) that the executor posts together and waits on before going on.

Pure data: no tensor, no process group. `schedules.py` builds and simulates the lists,
`pipeline.py` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union


class ScheduleError(ValueError):
    """Invalid (pp, microbatches, virtual stages), or an action order that is wrong or deadlocks."""


class Op(str, Enum):
    """What an action does. The values are torch.distributed.pipelining's `_ComputationType` values;
    `str()` and `format()` give the value (`F`, `SEND_B`) under every Python version."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"  # split backward: the input gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"  # split backward: the weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_compute(self) -> bool:
        return not self.is_comm

    @property
    def is_comm(self) -> bool:
        return self.is_send or self.is_recv

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_F, Op.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_F, Op.RECV_B)

    @property
    def to_next(self) -> bool:
        """A comm op whose peer is the next pipeline rank (activations out, gradients in)."""
        return self in (Op.SEND_F, Op.RECV_B)

    @property
    def partner(self) -> Op:
        """The op that matches this comm op on the peer: SEND_F ↔ RECV_F, SEND_B ↔ RECV_B."""
        return {Op.SEND_F: Op.RECV_F, Op.RECV_F: Op.SEND_F, Op.SEND_B: Op.RECV_B, Op.RECV_B: Op.SEND_B}[self]


@dataclass(frozen=True)
class Action:
    op: Op  # a name ("F", "SEND_B") is turned into its Op, so both spell the same action
    chunk: int  # model chunk on this rank, 0..v−1
    mb: int  # microbatch

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Op(self.op))

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" + (f".c{self.chunk}" if self.chunk else "")


PLACEMENTS = ("loop", "v")
"""How the pp·v model parts sit on the ranks. loop: chunk c of rank r holds part c·pp + r (activations go round
the ranks v times). v (two chunks): chunk 0 of rank r holds part r, chunk 1 part 2·pp − 1 − r, so the model goes
down the ranks and back up, and rank 0 holds both the first part and the last."""


def part_of(placement: str, pp: int, rank: int, chunk: int) -> int:
    """The model part chunk `chunk` of pipeline rank `rank` holds (see PLACEMENTS)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def place_of(placement: str, pp: int, part: int) -> tuple[int, int]:
    """(rank, chunk) holding model part `part`: the inverse of `part_of`."""
    if placement == "v":
        return (part, 0) if part < pp else (2 * pp - 1 - part, 1)
    return part % pp, part // pp


@dataclass(frozen=True)
class Schedule:
    """Every pipeline rank's action list, with the sizes that produced it."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"  # see PLACEMENTS
    deferrals: tuple[Optional[int], ...] = ()  # zero-bubble: weight passes each rank may leave waiting (None: unsplit)

    @property
    def label(self) -> str:
        """The name, with the zero-bubble weight-pass deferrals where they are capped."""
        if not self.deferrals:
            return self.name
        counts = ", ".join("unsplit" if d is None else str(d) for d in self.deferrals)
        return f"{self.name} (weight passes deferred per rank: {counts})"

    @property
    def num_parts(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last part (the head and the loss)."""
        return place_of(self.placement, self.pp, self.num_parts - 1)[0]

    def part(self, rank: int, chunk: int) -> int:
        """The model part (global virtual stage) chunk `chunk` of `rank` holds."""
        return part_of(self.placement, self.pp, rank, chunk)

    def neighbour(self, rank: int, chunk: int, step: int) -> Optional[tuple[int, int]]:
        """(rank, chunk) holding the part `step` (±1) away from this chunk's, None past either end."""
        part = self.part(rank, chunk) + step
        return place_of(self.placement, self.pp, part) if 0 <= part < self.num_parts else None

    def is_local(self, rank: int, chunk: int, step: int) -> bool:
        """Whether the neighbouring part `step` (±1) away is on this rank too (the V's turn): handed over in
        memory, with no comm action."""
        other = self.neighbour(rank, chunk, step)
        return other is not None and other[0] == rank

    @property
    def streams(self) -> list[str]:
        """Every comm stream some rank's actions use (`stream`)."""
        return sorted({self.stream(r, a) for r, acts in enumerate(self.actions) for a in acts if a.op.is_comm})

    def stream(self, rank: int, a: Action) -> str:
        """The comm stream comm action `a` travels on: activations or gradients (F, B), flowing down the ranks or
        up (+, −). Each stream is its own process group (NCCL runs a group's ops in order, and a V placement
        would otherwise queue the way back up behind the way down): loop placements use F+ and B−."""
        down = self.placement != "v" or a.chunk == 0
        kind = "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B"
        return kind + ("+" if down == (kind == "F") else "-")

    def peer(self, rank: int, a: Action) -> int:
        """The rank on the other end of comm action `a` of `rank`."""
        other = self.neighbour(rank, a.chunk, 1 if a.op.to_next else -1)
        if other is None:
            raise ScheduleError(f"rank {rank}: {a} has no peer (part {self.part(rank, a.chunk)} is at an end)")
        return other[0]


def steps(actions: tuple[Action, ...] | list[Action]) -> list[Union[Action, list[Action]]]:
    """Group a rank's actions into compute actions and batches of consecutive comm actions."""
    out: list[Union[Action, list[Action]]] = []
    for a in actions:
        if a.op.is_compute:
            out.append(a)
        elif out and isinstance(out[-1], list):
            out[-1].append(a)
        else:
            out.append([a])
    return out
