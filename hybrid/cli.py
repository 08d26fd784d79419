"""The command line's edge: bad input becomes one readable line and an exit status, never a traceback.

Modules raise their own exceptions (`ConfigError` and its `CheckpointError`, `ScheduleError`,
`CompressionError` — the last two translated into ConfigError by `validation.validate`); the entry
points turn the known ones into one line here:

- `hybrid.train` (under torchrun): `exit_on_error(body)` → `fail(msg)`: a `[rankN] hybrid: error: ...`
  line on every rank's stderr, a short wait so the launcher does not cut the other ranks' lines,
  exit status 2. `precheck` turns a Hydra composition error (bad override, unknown group option)
  into such a line before Hydra prints its multi-line report.
- the tools (`python -m hybrid.tools.<name>`): `run_tool(doc, argv, body, codes)` prints the
  report, or one `hybrid: error: ...` line and the status `codes` gives the error's class.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NoReturn, Optional, TypeVar, Union

from hybrid.config import ConfigError
from hybrid.overrides import App as App  # where @hydra.main sits, for precheck
from hybrid.overrides import check
from hybrid.overrides import one_line as one_line  # Hydra's errors as one line, for the tools

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and found a fault (e.g. export's verification)
EXIT_BAD_INPUT = 2  # config, data, checkpoint or command line: nothing was run or written
HELP = ("-h", "--help", "help")

Errors = Union[type[BaseException], tuple[type[BaseException], ...]]
ExitCodes = Sequence[tuple[Errors, int]]
"""(exception classes, exit status) pairs; the first pair whose classes match an error wins."""
BAD_INPUT: ExitCodes = ((ConfigError, EXIT_BAD_INPUT),)
T = TypeVar("T")


class UsageError(ConfigError):
    """Bad command-line input of a tool (unknown key, bad value): one line and exit status 2."""


def env_int(name: str, default: int) -> int:
    """An integer from the environment (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, …)."""
    return int(os.environ.get(name, default))


def say(line: str) -> None:
    """One line on stderr in one write, so the lines of two ranks never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def warn(msg: str) -> None:
    say(f"hybrid: {msg}")


def error_line(msg: str) -> str:
    """`hybrid: error: msg`, prefixed with `[rankN] ` when this is one of several torchrun ranks."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None and env_int("WORLD_SIZE", 1) > 1 else ""
    return f"{prefix}hybrid: error: {msg}"


def fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """One readable line on this rank's stderr, then exit with `code` (no traceback)."""
    import torch.distributed as dist

    say(error_line(msg))
    wait_for_peers_to_report()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


def wait_for_peers_to_report(timeout_s: float = 5.0) -> None:
    """Under torchrun, linger until every rank has printed its error (or `timeout_s`), so the
    launcher, which stops all workers as soon as one exits, does not cut the others' lines.
    Uses torchrun's own rendezvous store; no process group is needed."""
    world = env_int("WORLD_SIZE", 1)
    if world == 1 or "MASTER_ADDR" not in os.environ:
        return
    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT", 0), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        key = f"hybrid/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001  (best effort: never turn a clean error into a traceback)
        pass


def exit_code(e: BaseException, codes: ExitCodes) -> Optional[int]:
    """The exit status `codes` gives `e`, or None if `e` is not a known error (a bug: let it raise)."""
    return next((code for kinds, code in codes if isinstance(e, kinds)), None)


def exit_on_error(body: Callable[[], T], codes: ExitCodes = BAD_INPUT) -> T:
    """Run an entry point's `body`; a known error ends the process through `fail` (one line, its status)."""
    try:
        return body()
    except Exception as e:
        code = exit_code(e, codes)
        if code is None:
            raise
        fail(str(e), code)


def run_tool(doc: str, argv: Optional[list[str]], body: Callable[[list[str]], str],
             codes: ExitCodes = BAD_INPUT) -> int:
    """A tool's command line: `doc` for -h/--help/help, else print `body(argv)`'s report and return 0;
    a known error is one `hybrid: error: ...` line on stderr and the status `codes` gives it."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP for a in argv):
        print(doc.strip())
        return EXIT_OK
    try:
        print(body(argv))
    except Exception as e:
        code = exit_code(e, codes)
        if code is None:
            raise
        say(error_line(str(e)))
        return code
    return EXIT_OK


def precheck(argv: list[str], app: App = App("hybrid.train", None)) -> None:
    """Compose what the command line would run, once per job of a `--multirun` sweep, with Hydra's
    compose API and the run's own search path (`hydra.searchpath=[...]`, `--config-dir`, `--config-path`,
    `--config-name` honoured), so that a bad override, an unknown group option or a key the schema lacks
    (`+train.foo=1`) is one readable line instead of Hydra's multi-line report or a silent no-op.
    Flags that only print (`--help`, `--hydra-help`, `--info`, `--shell-completion`, `--version`) skip it."""
    try:
        check(argv, app)  # app: where @hydra.main sits (a relative --config-path starts there)
    except ConfigError as e:
        fail(str(e))
