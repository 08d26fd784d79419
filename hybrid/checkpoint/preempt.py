"""Save on a signal: a preempted or timed-out job saves the step it reached and exits cleanly.

`checkpoint.save_on_signal` names the signals (default SIGTERM and SIGUSR1; `[]` disables). While
`Trainer.fit` runs, such a signal only sets a flag (`Preemption.handle`): a handler that saved
could interrupt a collective halfway, and Python runs handlers between bytecodes anyway. At every
step boundary the ranks agree (`Preemption.agreed`), because a signal may reach one rank only (a
user's `kill` to one pid, a launcher that signals one process): one all_reduce(MAX) of a one-element
int32 tensor over the world — the signal number, 0 when none — as Megatron-LM's
DistributedSignalHandler all-gathers its flag each iteration. Every rank reads the same answer, so
all stop after the same step, save it through the normal `Checkpointer` path and return; the
process then exits 0.

Cost: that all_reduce, every step, only when `save_on_signal` is non-empty: 4 bytes, so pure
latency — one small-message round over the world (docs/checkpoints.md has the measured figure).
It is not training traffic and is not counted in the step's bytes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.checkpoint.files import distributed
from hybrid.config import ConfigError

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
REPEAT_S = 10.0
"""A repeat of the caught signal within this many seconds is the same request delivered twice, not a second one:
Slurm signals every process of a job step and torchrun's agent forwards the signal it got to its workers, so
under `srun torchrun` each rank receives one `scancel --signal`, or the time limit's or a preemption's SIGTERM,
twice within milliseconds."""


def parse_signals(names: Sequence[str]) -> tuple[signal.Signals, ...]:
    """`checkpoint.save_on_signal`'s names ("SIGTERM", or "TERM") as signals; an unknown or uncatchable
    name is a ConfigError."""
    out = []
    for name in names:
        key = str(name).upper()
        sig = getattr(signal.Signals, key if key.startswith("SIG") else "SIG" + key, None)
        if sig is None or sig in _UNCATCHABLE:
            raise ConfigError(f"checkpoint.save_on_signal: {name!r} is not a signal a process can catch "
                              "(use names such as SIGTERM, SIGUSR1; [] disables)")
        out.append(sig)
    return tuple(dict.fromkeys(out))


def flag_device(device: torch.device) -> torch.device:
    """Where a per-step flag is agreed: on the CPU wherever the world's group has a CPU backend (gloo; under
    NCCL `hybrid.train` adds one), so reading it never waits for the device's queue; else on `device`."""
    if not distributed() or "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return device


class Preemption:
    """The flag a signal sets and the ranks' agreement on it. Used as a context manager around the
    training loop: entering installs `handle` for the signals (main thread only: Python delivers
    signals there), leaving puts the previous handlers back."""

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.signals = parse_signals(names)
        self.device = device
        self.caught = 0  # the first signal number caught on this rank; 0: none
        self.caught_at = 0.0  # when (time.monotonic)
        self._previous: dict[signal.Signals, Any] = {}

    def handle(self, signum: int, frame: Optional[FrameType] = None) -> None:
        """The handler: remember the first signal, nothing else (no I/O, no collective). A second one
        while the first is pending (a rank stuck in a collective, a user insisting) takes its default
        action: the process ends at once; the first one repeated within REPEAT_S is the same request
        delivered twice (a job step under Slurm) and changes nothing."""
        if not self.caught:
            self.caught, self.caught_at = signum, time.monotonic()
            return
        if signum == self.caught and time.monotonic() - self.caught_at < REPEAT_S:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        self._previous.clear()

    def agreed(self) -> Optional[signal.Signals]:
        """At a step boundary, on every rank: the signal some rank caught (the highest number if several
        did), else None. One all_reduce(MAX) over the world when several ranks run; nothing at all (no
        collective) when `save_on_signal` is empty, which every rank knows from the same config."""
        if not self.signals:
            return None
        flag = torch.tensor([self.caught], dtype=torch.int32, device=flag_device(self.device))
        flag.host_only = True  # type: ignore[attr-defined]  # a host value: reading it waits for no device work
        if distributed():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value) if value else None
