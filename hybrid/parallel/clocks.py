"""The clocks under the communication timer (`timing`): when an async collective completed, on the host or on
the device, and the span one collective's time is kept in.

`HostClock` (`time.perf_counter`; completion from the work's future callback, or, for works without a future —
gloo's point-to-point ones —, from a watcher thread's wait, the one wait such a work allows: `Span.claim`) on
CPU; `CudaClock` (CUDA events on the current stream; completion from an event recorded in the work's future
callback) on CUDA.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

BLOCKING, ASYNC, WAIT = "blocking", "async", "wait"
Mark = Union[float, "torch.cuda.Event"]
_CLAIMS = threading.Lock()  # a watched work's one wait: the watcher's or its owner's (`Span.claim`)
BLOCKING, ASYNC, WAIT = "blocking", "async", "wait"


class HostClock:
    """`time.perf_counter` on the calling thread; an async work's end is when its future completes, or,
    for works without a future (gloo's point-to-point ones), when a watcher thread's wait on it returns."""

    def __init__(self) -> None:
        self._watched: Optional[queue.SimpleQueue] = None
        self._pid = 0  # the process the watcher thread runs in (a forked child starts its own)

    def mark(self) -> float:
        return time.perf_counter()

    def when_done(self, work: dist.Work, span: Span) -> bool:
        """Set `span.end` once `work` completes; True when a watcher thread now waits on `work` (a gloo
        p2p work may be waited on once only: the owner then waits through `span.wait`)."""
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            span.ended = threading.Event()  # before the watcher can note the end: the owner blocks on it
            self._watcher().put((work, span))
            return True
        future.add_done_callback(lambda _: span.set_end(time.perf_counter()))
        return False

    def _watcher(self) -> queue.SimpleQueue:
        if self._watched is None or self._pid != os.getpid():
            self._watched, self._pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_watch, args=(self._watched,), daemon=True, name="hybrid-comm-timer").start()
        return self._watched

    def seconds(self, a: float, b: float) -> float:
        return b - a


def _watch(works: queue.SimpleQueue) -> None:
    """The watcher thread: wait for each work in turn (the wait releases the GIL), note when it ended,
    and keep a failed wait's error for the owner (`Span.wait` raises it). A work whose owner came to wait on
    it first is the owner's (`Span.claim`): the watcher may be held up by an earlier work that completes only
    after the owner moves on (a pipeline send whose receiver waits on this rank), so the owner never waits
    for the watcher to reach its work."""
    while True:
        work, span = works.get()
        if not span.claim():
            continue
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            span.error = e
        span.set_end(time.perf_counter())


class CudaClock:
    """CUDA events on the current stream; an async work's end is an event recorded in its future's callback,
    whose current stream already waits on the collective (a device-side dependency: the host never blocks,
    and the work keeps holding its tensors until its owner waits on it)."""

    def __init__(self) -> None:
        self.watch = torch.cuda.Stream()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def when_done(self, work: dist.Work, span: Span) -> bool:
        try:
            future = work.get_future()
        except RuntimeError:  # no future: the watcher stream waits (the caller keeps the tensors alive)
            with torch.cuda.stream(self.watch):
                work.wait()
                span.set_end(self.mark())
            return False
        future.then(lambda _: span.set_end(self.mark()))
        return False

    def seconds(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3


Clock = Union[HostClock, CudaClock]


def clock_for(device: torch.device) -> Clock:
    return CudaClock() if device.type == "cuda" else HostClock()


@dataclass
class Span:
    group: str
    op: str
    kind: str  # BLOCKING, ASYNC or WAIT
    start: Mark
    end: Optional[Mark] = None
    error: Optional[Exception] = None  # a watched work's failed wait
    exposed: bool = False  # the training thread waited on it (the outermost blocking or wait span)
    claimed: bool = False  # a watched work's one wait is taken (by the watcher thread or by its owner)
    ended: Optional[threading.Event] = None  # a watched work's: set with `end`, what its owner blocks on

    def set_end(self, mark: Mark) -> None:
        self.end = mark
        if self.ended is not None:
            self.ended.set()

    def claim(self) -> bool:
        """Take the one wait a watched work allows (gloo's p2p works count their completions: a second
        waiter would block for ever); False when the other thread has it."""
        with _CLAIMS:
            taken, self.claimed = self.claimed, True
        return not taken

    def wait(self, work: dist.Work, watched: bool) -> None:
        """Wait for `work`, this span's collective: directly (a watched work the watcher has not reached
        yet is claimed, its end noted here), or, when the watcher thread already waits on it, blocked on
        `ended` until the watcher noted its end (raising the error its wait raised)."""
        if not watched or self.claim():
            work.wait()
            if watched:
                self.set_end(time.perf_counter())
            return
        assert self.ended is not None, "a watched span gets its event from HostClock.when_done"
        self.ended.wait()
        if self.error is not None:
            raise self.error
