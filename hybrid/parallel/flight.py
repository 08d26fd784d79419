"""A flight recorder of the last collectives this process entered: what a hang leaves behind to read.

Every collective passes through the `CommTimer` (`timing.py`), timed or not; it notes each one here — its
sequence number, the training step, the group's name, the operation, when it started and whether it has
finished (a blocking one when it returns; an async one is marked `async` at launch, its wait a blocking
`wait` note of its own). Only the last `size` are kept (a ring), so recording costs a tuple per collective.

When a collective times out or loses a peer, each rank that notices writes its ring to
`<logging.dir>/flight/rank<N>.txt` (`dump`), and the one error line points there: the files of the ranks
side by side show which collective each was in, and so which rank stopped answering (the one without a
file, or the one whose last collective the others wait in). NCCL keeps its own, richer recorder
(`TORCH_NCCL_TRACE_BUFFER_SIZE`); this one works on every backend and names groups as hybrid does.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Optional


class Note:
    """One collective in the ring; a context manager that marks it done when the collective returns."""

    __slots__ = ("seq", "step", "group", "op", "at", "state")

    def __init__(self, seq: int, step: int, group: str, op: str, at: float, state: str) -> None:
        self.seq, self.step, self.group, self.op, self.at, self.state = seq, step, group, op, at, state

    def __enter__(self) -> Note:
        return self

    def __exit__(self, kind: Optional[type], *_: object) -> None:
        self.state = "done" if kind is None else "failed"

    def row(self) -> str:
        return f"{self.seq:>7} {self.step:>6}  {self.group:<10} {self.op:<22} {self.at:>10.3f}  {self.state}"


class FlightRecorder:
    """The ring of the last `size` collectives (see the module doc). `step` is set by the trainer's step."""

    def __init__(self, size: int = 32) -> None:
        self.ring: deque[Note] = deque(maxlen=size)
        self.seq, self.step, self.origin = 0, 0, time.monotonic()

    def note(self, group: str, op: str, state: str = "running") -> Note:
        """Record a collective entering now (`running` until its note is exited)."""
        self.seq += 1
        entry = Note(self.seq, self.step, group, op, time.monotonic() - self.origin, state)
        self.ring.append(entry)
        return entry

    def render(self, rank: int) -> str:
        head = (f"flight recorder of rank {rank} (pid {os.getpid()}): its last {len(self.ring)} collectives, oldest "
                f"first; 'at' is seconds since the process started, now {time.monotonic() - self.origin:.3f}\n"
                f"{'seq':>7} {'step':>6}  {'group':<10} {'op':<22} {'at (s)':>10}  state")
        return "\n".join([head, *(n.row() for n in self.ring)]) + "\n"

    def dump(self, folder: Path, rank: int) -> Optional[Path]:
        """Write the ring to `folder/rank<rank>.txt`; the path, or None if it cannot be written (the error line
        this serves must still come out)."""
        path = folder / f"rank{rank}.txt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(self.render(rank))
        except OSError:
            return None
        return path
