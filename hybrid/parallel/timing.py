"""Clocks on communication: how long each collective took, how long the training thread waited on it,
and where a step's time went.

`CommTimer` records, for the step it is switched on for, spans on one clock:

- `collective(group, op)`: a blocking collective (the TP regions, the tied-embedding and sequence-parallel
  sums, the gradient norm, a pipeline p2p batch): the thread waits all along, so its seconds count both
  in the op's time and in the group's *exposed* time.
- `launched(group, op, work, start)`: an async collective (a DP bucket's all-reduce, a compression hook's
  parts): its time runs from launch to completion, which the training thread does not see.
- `waiting(group)`: the thread blocked on a group's pending work (`GradSync.finish`): exposed time only.
- `phase(name, start, end)`: a region of the step (data, forward, backward, optimizer). An exposed span
  inside a phase is taken out of it, so compute is forward + backward without the TP waits inside them.

Two clocks, one interface (`mark`, `when_done`, `seconds`; `clocks.py`, with the `Span`): `HostClock` on CPU,
`CudaClock` on CUDA. CUDA events are read only after the step's final synchronize, so timing adds no host sync
inside the step.

With the timer off (`on=False`), every entry point returns at its first test: nothing is recorded.
While a torch profiler runs (`profiling=True`), collectives are also labelled `comm:<group>:<op>`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel.clocks import ASYNC, BLOCKING, WAIT, Clock, HostClock, Mark, Span
from hybrid.parallel.flight import FlightRecorder


@dataclass
class StepTiming:
    """One step's figures, in seconds from the step's start, resolved from the marks."""

    step_s: float = 0.0
    op_s: dict[tuple[str, str], float] = field(default_factory=dict)  # union of the op's spans
    group_s: dict[str, float] = field(default_factory=dict)  # union of the group's spans
    exposed_s: dict[str, float] = field(default_factory=dict)  # the thread waited on the group
    exposed_op_s: dict[tuple[str, str], float] = field(default_factory=dict)  # … on this op (waits: op "wait")
    phase_s: dict[str, float] = field(default_factory=dict)  # phase time, exposed spans inside taken out
    phase_spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    intervals: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)


class CommTimer:
    """Spans and phases of the step it is switched on for (see the module doc)."""

    def __init__(self) -> None:
        self.on = False
        self.profiling = False
        self.thread = 0  # the training thread: only its waits are exposed time
        self.depth = 0  # exposed spans open on it (a span inside another is not exposed again)
        self.clock: Clock = HostClock()
        self.spans: list[Span] = []
        self.phases: list[tuple[str, Mark, Mark]] = []
        self.origin: Optional[Mark] = None
        self.end: Optional[Mark] = None
        self.flight = FlightRecorder()  # every collective, timed or not: what a hang leaves behind
        self.across = 0  # > 0: async launches run across steps (`detached`)

    def begin_step(self, on: bool, step: int = 0) -> None:
        """Start step `step` (the flight recorder's); record its spans only if `on`."""
        self.flight.step = step
        self.spans, self.phases, self.on = [], [], on
        self.thread, self.depth = threading.get_ident(), 0
        self.origin = self.clock.mark() if on else None

    def mark(self) -> Optional[Mark]:
        return self.clock.mark() if self.on else None

    def collective(self, group: str, op: str) -> contextlib.AbstractContextManager:
        """Time a blocking collective of `group` (its seconds are also exposed); note it in the flight recorder."""
        note = self.flight.note(group, op)
        if not (self.on or self.profiling):
            return note
        return _Both(note, self._span(group, op, BLOCKING))

    def waiting(self, group: str, op: str = "wait") -> contextlib.AbstractContextManager:
        """Time the thread waiting on `group`'s pending async work (exposed seconds only); note the wait."""
        note = self.flight.note(group, op)
        if not self.on:
            return note
        return _Both(note, self._span(group, op, WAIT))

    def launched(self, group: str, op: str, work: Optional[dist.Work], start: Optional[Mark]) -> tuple[Span, bool]:
        """An async collective launched at `start`: its span ends when `work` completes. Returns the span
        and whether a watcher thread waits on `work` (then wait on it only through `span.wait`)."""
        self.flight.note(group, op, "async")
        if not self.on or work is None or start is None or self.across:
            return UNTIMED, False
        span = Span(group, op, ASYNC, start)
        self.spans.append(span)
        return span, self.clock.when_done(work, span)

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Async collectives launched inside run across steps (an overlapped outer exchange): no span of this
        step waits for them; the wait where they land is timed (`waiting`)."""
        self.across += 1
        try:
            yield
        finally:
            self.across -= 1

    def phase(self, name: str, start: Optional[Mark], end: Optional[Mark] = None) -> None:
        """A region of the step from `start` to `end` (now when None)."""
        if self.on and start is not None:
            self.phases.append((name, start, end if end is not None else self.clock.mark()))

    @contextlib.contextmanager
    def timed_phase(self, name: str) -> Iterator[None]:
        start = self.mark()
        yield
        self.phase(name, start)

    def label(self, group: str, op: str) -> contextlib.AbstractContextManager:
        """While a profiler runs, name the collective by its group in the trace."""
        return torch.profiler.record_function(f"comm:{group}:{op}") if self.profiling else _NULL

    @contextlib.contextmanager
    def _span(self, group: str, op: str, kind: str) -> Iterator[None]:
        with self.label(group, op):
            if not self.on:
                yield
                return
            outer = self.depth == 0 and threading.get_ident() == self.thread
            span = Span(group, op, kind, self.clock.mark(), exposed=outer)
            self.depth += outer
            try:
                yield
            finally:
                self.depth -= outer
            span.end = self.clock.mark()
            if kind != WAIT or outer:  # a nested wait adds nothing: its time is already the outer span's
                self.spans.append(span)

    def end_step(self) -> Optional[StepTiming]:
        """Close the step; its figures once every mark can be read (call after the step's final
        synchronize on CUDA), or None when it was not recorded."""
        if not self.on:
            return None
        self.on = False
        end = self.clock.mark()
        return resolve(self.clock, self.origin, end, _finished(self.spans), self.phases)


class _Both:
    """Two context managers entered and exited together (the flight note outside the timed span)."""

    def __init__(self, outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


_NULL = contextlib.nullcontext()
UNTIMED = Span("", "", ASYNC, 0.0)
"""The span of an untimed async work: `UNTIMED.wait(work, False)` is `work.wait()`."""


def _finished(spans: list[Span], patience_s: float = 5.0) -> list[Span]:
    """`spans` once every async end is in: a future's waiters may wake just before its callbacks run."""
    deadline = time.monotonic() + patience_s
    while any(s.end is None for s in spans) and time.monotonic() < deadline:
        time.sleep(0.0005)
    return [s for s in spans if s.end is not None]


def resolve(clock: Clock, origin: Mark, end: Mark, spans: list[Span],
            phases: list[tuple[str, Mark, Mark]]) -> StepTiming:
    """Seconds from the step's start for every span and phase, then the unions and the phase remainders."""
    at = {}

    def sec(m: Mark) -> float:
        key = id(m)
        if key not in at:
            at[key] = clock.seconds(origin, m)
        return at[key]

    out = StepTiming(step_s=sec(end))
    ivals: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    exposed_ivals: list[tuple[float, float]] = []
    for s in spans:
        iv = (sec(s.start), sec(s.end))
        if s.kind != WAIT:
            ivals[(s.group, s.op)].append(iv)
        if s.exposed:
            out.exposed_s[s.group] = out.exposed_s.get(s.group, 0.0) + iv[1] - iv[0]
            out.exposed_op_s[(s.group, s.op)] = out.exposed_op_s.get((s.group, s.op), 0.0) + iv[1] - iv[0]
            exposed_ivals.append(iv)
    out.intervals = dict(ivals)
    out.op_s = {k: union_length(v) for k, v in ivals.items()}
    for g in {g for g, _ in ivals}:
        out.group_s[g] = union_length([iv for (h, _), v in ivals.items() if h == g for iv in v])
    for name, a, b in phases:
        iv = (sec(a), sec(b))
        out.phase_spans.setdefault(name, []).append(iv)
        inside = sum(overlap(iv, e) for e in exposed_ivals)
        out.phase_s[name] = out.phase_s.get(name, 0.0) + max(0.0, iv[1] - iv[0] - inside)
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `intervals` (overlapping async spans are counted once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))

