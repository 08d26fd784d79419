"""Collective timeouts: every process group of a run gets `parallel.timeout_s`, and a collective that timed
out, or lost its peer, becomes one line naming the group, its ranks, the operation and the step.

Two timeouts, as torchtitan's: `parallel.timeout_s` (Megatron's 10 minutes) while the run starts and takes its
first step — rendezvous, loading, the first compilation and allocation may all be slow —, then
`parallel.train_timeout_s` (`Timeouts.training`; 100 s by default: a stopped rank ends the run within about two
minutes) on every process group of this process but the async checkpoint saves' own, whose collectives wait on
the slowest rank's disk in the background. Around a checkpoint save and an evaluation, the waits that may take
long on a slow rank, the start-up timeout applies again (`Timeouts.relaxed`). A timeout is a setting of each
process's own groups: no collective changes it, so ranks switch at the same step boundary but need not agree.

Without a timeout a rank that stops answering (hung, SIGSTOPped, deadlocked) holds every peer in its
collective for torch's default of 30 minutes, silently. With one, gloo raises in each waiting rank after
`timeout_s` (`RuntimeError: ... Timed out waiting 5000ms for recv operation to complete`; a peer that died
instead gives `Connection closed by peer`), and `collective_fault` turns that exception into the line. NCCL
aborts the communicator on the timeout itself (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default) and ends the
process with its own report.

Which group: the exception does not say, so `where` walks its traceback from the innermost frame out and
takes the first process group it finds — an argument of `torch.distributed`'s call (`group=`), a local, or
a `group`/`process_group`/`pg` attribute of the frame's `self` (a DP bucket's wait, a p2p helper) — named
by the name `ParallelContext.build` gave it (`collectives.name_group`); `group=None` is the world.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any, Optional

import torch.distributed as dist

from hybrid.parallel.collectives import group_name

MARKERS = ("Timed out waiting", "Application timeout caused pair closure", "Connection closed by peer",
           "Connection reset by peer")
"""gloo's words for a peer that stopped answering (the timeout fired, or fired before on the same pair) or died."""
_C10D = "torch/distributed/distributed_c10d.py"
_GROUP_ATTRS = ("group", "process_group", "pg")
_NOISE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]|Got the following error when running the callback:|RuntimeError:")


class CollectiveFault(RuntimeError):
    """A collective timed out or lost a peer while training: one line (`collective_fault`), exit 1."""


class Timeouts:
    """The timeout this process's groups wait with now: `start_s` until `training()`, then `train_s` (never longer
    than `start_s`; 0: `start_s` throughout), `start_s` again inside `relaxed()`."""

    def __init__(self, start_s: float, train_s: float) -> None:
        self.start_s = self.now_s = start_s
        self.train_s = min(train_s or start_s, start_s)

    @property
    def key(self) -> str:
        """The setting the timeout in force comes from (the fault line names it)."""
        return "parallel.timeout_s" if self.now_s == self.start_s else "parallel.train_timeout_s"

    def training(self) -> None:
        """After the first step: the training timeout (a no-op once set, or when it is the start-up one)."""
        if self.now_s != self.train_s:
            self._set(self.train_s)

    @contextlib.contextmanager
    def relaxed(self, when: bool = True) -> Iterator[None]:
        """The start-up timeout for what runs inside (`when`), the timeout before it again after."""
        before = self.now_s
        if when and before != self.start_s:
            self._set(self.start_s)
        try:
            yield
        finally:
            if self.now_s != before:
                self._set(before)

    def _set(self, seconds: float) -> None:
        for group in own_groups():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
        self.now_s = seconds


def own_groups() -> list[dist.ProcessGroup]:
    """Every process group this process belongs to (torch's registry), but the async checkpoint saves'."""
    if not dist.is_initialized():
        return []
    c10d = dist.distributed_c10d
    return [pg for pg in c10d._world.pg_map if group_name(pg) != "checkpoint" and not c10d._rank_not_in_group(pg)]


def timeout_of(seconds: Optional[float]) -> Optional[timedelta]:
    """`parallel.timeout_s` as torch.distributed takes it (None: torch's default)."""
    return None if seconds is None else timedelta(seconds=seconds)


def collective_fault(e: BaseException, step: Optional[int], timeout_s: float, key: str = "parallel.timeout_s"
                     ) -> Optional[str]:
    """The one line for `e` when it is a collective that timed out or lost a peer (gloo's words, or one of
    torch.distributed's DistError kinds: a store or NCCL failure), else None. `step`: the steps completed
    (None: during start-up, before the first); `timeout_s`: the timeout in force, set by `key`."""
    text = str(e)
    if isinstance(e, CollectiveFault) or not (isinstance(e, dist.DistError) or (
            isinstance(e, RuntimeError) and any(m in text for m in MARKERS))):
        return None
    pg, op, stepping = where(e.__traceback__)
    group, ranks = _named(pg)
    lines = text.strip().splitlines() or [type(e).__name__]
    detail = _NOISE.sub("", next((ln for ln in lines if any(m in ln for m in MARKERS)), lines[0])).strip()
    when = "during start-up" if step is None else f"in step {step + 1}" if stepping else f"after step {step}"
    return (f"collective {op} on the {group} group ({ranks}) failed {when}: {detail}; a rank of that group "
            f"stopped answering for {key}={timeout_s:g} s (hung, stopped or dead)")


def _named(pg: Optional[dist.ProcessGroup]) -> tuple[str, str]:
    """(the group's name, its ranks) for the line; the world when `pg` is None or torch's default group."""
    up = dist.is_initialized()
    if pg is None or (up and pg == dist.distributed_c10d._get_default_group()):
        return "world", f"ranks {list(range(dist.get_world_size()))}" if up else "every rank"
    name = group_name(pg)
    name = getattr(pg, "group_desc", "") or "unnamed" if name == "other" else name
    return name, f"ranks {dist.get_process_group_ranks(pg)}"


def where(tb: Optional[TracebackType]) -> tuple[Optional[dist.ProcessGroup], str, bool]:
    """(the process group, the operation, inside a training step) of `tb`: the group of the innermost frame
    that names one (None: the world, torch's default group), torch.distributed's function if one was
    called, and whether a `train_step` frame is on the way (else the fault came after a step: metrics,
    eval, a save)."""
    frames: list[FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    op = next((f.f_code.co_name for f in reversed(frames) if f.f_code.co_filename.endswith(_C10D)), "wait")
    stepping = any(f.f_code.co_name == "train_step" for f in frames)
    for frame in reversed(frames):
        found, pg = _group_in(frame)
        if found:
            return pg, op, stepping
    return None, op, stepping


def _group_in(frame: FrameType) -> tuple[bool, Optional[dist.ProcessGroup]]:
    """(whether `frame` names a group, which: None = the world)."""
    local = frame.f_locals
    for value in local.values():
        if isinstance(value, dist.ProcessGroup):
            return True, value
    if frame.f_code.co_filename.endswith(_C10D) and "group" in local and local["group"] is None:
        return True, None
    holder: Any = local.get("self")
    for attr in _GROUP_ATTRS:
        value = getattr(holder, attr, None)
        if isinstance(value, dist.ProcessGroup):
            return True, value
    return False, None
