"""A torchrun entry for the fault-tolerance tests: `python -m killer <hybrid.train overrides>`
(with tests/e2e on PYTHONPATH) runs `hybrid.train.main()`, and rank `HYBRID_KILL_RANK` (default 1; `all`: every
rank) SIGKILLs itself, or stops, hangs or holds. Ranks forked from a test (hybrid.testing.cli_runs) run `main`,
with the same environment variables. `HYBRID_KILL` is a comma-separated list, one fault per attempt: its A-th item
acts on attempt A (`TORCHELASTIC_RESTART_COUNT`, plus `SLURM_RESTART_COUNT` in a requeued Slurm job), so one
torchrun launch (or one Slurm job) can meet several faults in a row; attempts past the list (and empty items) run
clean.

- `HYBRID_KILL=step:N`: at the start of optimizer step N (after steps 1..N-1 completed);
- `HYBRID_KILL=save:N`: while writing its shard file of checkpoint `step_%07d` % N, after its
  first item is in the file (flushed), so the shard is cut short and `.metadata` never written;
- `HYBRID_KILL=stop:N`: SIGSTOP instead of SIGKILL at the start of step N: a hung rank, alive but silent,
  that the others must detect by their collective timeout (`parallel.timeout_s`).
- `HYBRID_KILL=hang:N`: a hung rank as `stop`, but sleeping with SIGTERM's default action, so torchrun's SIGTERM
  ends it at once (a SIGSTOPped worker ignores it until torchrun's 30 s shutdown grace ends in SIGKILL).
- `HYBRID_KILL=hold:N`: no kill: at the start of step N the rank waits until it has caught a signal of
  `checkpoint.save_on_signal` (the flag its handler sets; at most HOLD_S), so a signal the test sends once
  step N − 1 is logged lands before step N + 1 however fast or slow the machine runs the steps.

A real SIGKILL, not an exception: no `finally`, no atexit, no flush. Every rank prints one
`killer: attempt A rank R` line on stderr at start so the test can count attempts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

HOLD_S = 120.0  # `hold`: the longest wait for the signal (then the run goes on, and the test fails on it)


def _say(line: str) -> None:
    """One write(2) per line: ranks share the stderr pipe, and print() under PYTHONUNBUFFERED=1 writes the
    text and its newline separately, so two ranks' lines could merge."""
    os.write(sys.stderr.fileno(), f"killer: {line}\n".encode())


def _die(what: str, sig: signal.Signals = signal.SIGKILL) -> None:
    _say(f"{sig.name} rank {os.environ.get('RANK', '0')} {what}")
    os.kill(os.getpid(), sig)


def _at_step(step: int, act: Callable[[Any], None]) -> None:
    """Patch `Trainer.train_step` so that `act(trainer)` runs at the start of optimizer step `step`."""
    from hybrid.trainer import Trainer

    original = Trainer.train_step

    def train_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if self.step == step - 1:
            act(self)
        return original(self, *args, **kwargs)

    Trainer.train_step = train_step  # type: ignore[method-assign]


def _kill(step: int, sig: signal.Signals = signal.SIGKILL) -> None:
    _at_step(step, lambda _: _die(f"at the start of step {step}", sig))


def _hang(step: int) -> None:
    def hang(_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # checkpoint.save_on_signal's handler would outlive it
        _say(f"hang rank {os.environ.get('RANK', '0')} at the start of step {step}")
        while True:
            signal.pause()

    _at_step(step, hang)


def _hold(step: int) -> None:
    def hold(trainer: Any) -> None:
        _say(f"rank {os.environ.get('RANK', '0')} holds at the start of step {step} until a signal")
        deadline = time.monotonic() + HOLD_S
        while not trainer.checkpointer.preemption.caught and time.monotonic() < deadline:
            time.sleep(0.01)

    _at_step(step, hold)


def _kill_mid_save(step: int) -> None:
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item
    folder = f"step_{step:07d}"

    def write_item(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(transforms, stream, *args, **kwargs)
        if os.path.basename(os.path.dirname(str(getattr(stream, "name", "")))) == folder:
            stream.flush()
            _die(f"mid-write of {stream.name} ({stream.tell()} bytes written)")
        return result

    filesystem._write_item = write_item


def arm() -> None:
    """Patch the kill point HYBRID_KILL names for this attempt into this process (chosen rank only)."""
    attempt = str(sum(int(os.environ.get(k, "0")) for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")))
    rank = os.environ.get("RANK", "0")
    _say(f"attempt {attempt} rank {rank}")
    specs = os.environ.get("HYBRID_KILL", "").split(",")
    spec = specs[int(attempt)] if int(attempt) < len(specs) else ""
    if not spec or os.environ.get("HYBRID_KILL_RANK", "1") not in (rank, "all"):
        return
    kind, step = spec.split(":")
    {"step": _kill, "save": _kill_mid_save, "hold": _hold, "hang": _hang,
     "stop": lambda n: _kill(n, signal.SIGSTOP)}[kind](int(step))


def main(pids: Optional[Path] = None) -> None:
    """`hybrid.train.main()` with this attempt's fault armed (`python -m killer`, or a forked rank's entry);
    `pids`: a folder where the rank first writes its pid, in a file named by its rank."""
    if pids is not None:
        (pids / os.environ.get("RANK", "0")).write_text(str(os.getpid()))
    arm()
    from hybrid.train import main as train

    train()


if __name__ == "__main__":
    main()
