"""A process that torchrun started dies with its torchrun agent: `hold(os.environ)`, run by `hybrid/__init__.py`.

torchrun starts every worker in a session of its own, so when the agent itself dies without stopping them
(SIGKILL, the OOM killer, a crash) no signal reaches the workers: they would train on to the end with
nobody supervising, saving checkpoints, and a relaunch of the run would find them still writing into its
folders. On Linux `hold` asks the kernel (`prctl(PR_SET_PDEATHSIG)`) to send this process SIGKILL when its
parent, the agent, exits; elsewhere (macOS) a daemon thread polls `os.getppid()` once a second and sends
the SIGKILL itself when the parent changes. Nothing is collective: each process watches its own parent.

Why SIGKILL and not SIGTERM: SIGTERM is a default `checkpoint.save_on_signal` signal, so it would start a
save — a collective save with no supervisor left, while a relaunch (by the user or a scheduler) may
already have resumed the newest checkpoint and be writing into the same folder: two writers. SIGKILL
stops the worker where it is; at worst it leaves a step folder without `.metadata`, which
`checkpoint.resume=auto` skips. The orderly stop is untouched: an agent asked to stop (SIGTERM, SIGINT,
Slurm's preemption) forwards the signal to its workers and waits for them (they save), so they are gone
before it exits and the death signal never fires.

When: importing the package `hybrid` holds, so every entry point (`python -m hybrid.train`, the tools,
their console scripts) is covered before it imports torch, some 30 ms after the interpreter starts. The
race: the agent may die before that. The parent is read before arming and again after; a different parent
means the agent is already gone (this process was adopted by init or a subreaper), and the process ends
at once, as the kernel would have ended it. An agent that died in the interpreter's own start-up cannot
be told from a live one (torchrun may itself be pid 1 in a container).

Only under torchrun (`TORCHELASTIC_RUN_ID` is set): a plain `python -m hybrid.train`, or a test's forked
rank, has an ordinary parent (a shell, pytest) and keeps running when it exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL = signal.SIGKILL
POLL_S = 1.0  # the watchdog's period where there is no prctl


def under_torchrun(environ: Mapping[str, str]) -> bool:
    """torchrun's agent sets TORCHELASTIC_RUN_ID for the workers it starts (their own children inherit it, and
    then die with the worker that started them: that is the parent they watch)."""
    return "TORCHELASTIC_RUN_ID" in environ


def hold(environ: Mapping[str, str]) -> None:
    """Under torchrun: die (SIGKILL) when the parent, the torchrun agent, dies — now if it already has."""
    if not under_torchrun(environ):
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        set_death_signal(DEATH_SIGNAL)
    else:
        threading.Thread(target=_watch, args=(parent,), name="lifeline", daemon=True).start()
    if os.getppid() != parent:  # the agent died before the kernel (or the watchdog) was told
        os.kill(os.getpid(), DEATH_SIGNAL)


def set_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) through libc: the kernel sends `sig` to this process when the thread
    that started it exits (torchrun starts its workers from the agent's main thread)."""
    import ctypes  # here: `import hybrid` outside torchrun pays nothing for it

    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols, libc's prctl among them
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def _watch(parent: int) -> None:
    """The fallback without prctl: a reparented process has a new parent pid."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), DEATH_SIGNAL)
