"""Run an entry point's `main()` as a real process, fast: fork this (already imported) interpreter once per
command line instead of starting a fresh Python (seconds of imports each).

The child is a real process: it changes into its own working directory, sets `sys.argv` and the given
environment, sends its stdout/stderr (the Python objects and file descriptors 1 and 2) into files, calls
`main()` and ends with `main`'s exit status (`SystemExit`'s code; 1 and the traceback for an uncaught
exception; 0 when it returns). Hydra's global state and the process group live only in the child, so
every command line starts from the same clean state. Use it only where the parent holds no threads that
a fork would break (a test process with OMP_NUM_THREADS=1 and no process group).

`run_forked_ranks` starts `world` such children at once, each with the environment torchrun gives its
ranks (RANK, WORLD_SIZE, LOCAL_*, MASTER_ADDR/MASTER_PORT of a store this process holds, as torchrun's agent
does: TORCHELASTIC_USE_AGENT_STORE): one multi-rank run of the real entry point, each rank's exit status and
output apart, without torchrun's seconds of start-up.

`refusal` is the in-process counterpart for bad input that composition or validation refuses: the message
`hybrid.train` would print after `hybrid: error:`, without a process (the edge that prints it is the same
for every such message, and forked runs check it).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from hybrid.testing.ranks import rendezvous_port


@dataclass(frozen=True)
class CliRun:
    """What a command line did: its exit status and what it printed."""

    code: int
    stdout: str
    stderr: str

    @property
    def returncode(self) -> int:
        """`subprocess.CompletedProcess`'s name for `code`: a fork and a fresh process read alike."""
        return self.code

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if "hybrid: error:" in line]


def run_forked(main: Callable[[], Optional[int]], argv: Sequence[str], cwd: Path,
               env: Optional[Mapping[str, str]] = None, timeout_s: float = 120.0, prog: str = "hybrid") -> CliRun:
    """`main()` with `sys.argv = [prog, *argv]` in a forked child working in `cwd` (see the module docstring);
    a child still running after `timeout_s` is killed and reported with status -9."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        sys.stdout.flush(), sys.stderr.flush()
        pid = _fork()
        if pid == 0:
            _child(main, [prog, *argv], cwd, env or {}, out, err)
        return CliRun(_wait(pid, timeout_s), out.read_text(errors="replace"), err.read_text(errors="replace"))


def run_forked_ranks(main: Callable[[], Optional[int]], argv: Sequence[str], cwd: Path, world: int,
                     env: Optional[Mapping[str, str]] = None, timeout_s: float = 120.0) -> list[CliRun]:
    """`main()` as the `world` ranks of one run (see the module docstring), their results by rank; every
    child still running after `timeout_s` (all ranks share the deadline) is killed and reported with -9."""
    with rendezvous_port() as port, tempfile.TemporaryDirectory() as tmp:
        files, pids = [(Path(tmp) / f"out{r}", Path(tmp) / f"err{r}") for r in range(world)], []
        for rank, (out, err) in enumerate(files):
            ranked = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                      "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "TORCHELASTIC_USE_AGENT_STORE": "True"}
            sys.stdout.flush(), sys.stderr.flush()
            pid = _fork()
            if pid == 0:
                _child(main, ["hybrid", *argv], cwd, ranked, out, err)
            pids.append(pid)
        deadline = time.monotonic() + timeout_s
        codes = [_wait(pid, max(0.0, deadline - time.monotonic())) for pid in pids]
        return [CliRun(code, out.read_text(errors="replace"), err.read_text(errors="replace"))
                for code, (out, err) in zip(codes, files)]


def _fork() -> int:
    """`os.fork` with the heap frozen (`gc.freeze`) across it: the child's collections skip the inherited
    objects instead of copying every page of the parent's heap."""
    gc.freeze()
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid:  # the parent only: the child keeps the inherited heap frozen
        gc.unfreeze()
    return pid


def _child(main: Callable[[], Optional[int]], argv: list[str], cwd: Path, env: Mapping[str, str], out: Path,
           err: Path) -> None:
    """The forked side: never returns (os._exit with main's status)."""
    code = 1
    try:
        sys.stdout, sys.stderr = _redirect(1, out), _redirect(2, err)
        os.chdir(cwd)
        os.environ.update(env)
        sys.argv = argv
        status = main()
        code = status if isinstance(status, int) else 0  # as `sys.exit(main())`: a returned status is the exit's
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            sys.stderr.write(e.code + "\n")
    except BaseException:  # noqa: BLE001  (the child reports any failure as a real process would)
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _redirect(fd: int, path: Path) -> TextIO:
    f = open(path, "w", buffering=1)  # noqa: SIM115  (lives until the child exits)
    os.dup2(f.fileno(), fd)
    return f


def _wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9
