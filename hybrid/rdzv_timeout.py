"""launch/multinode.sh's stderr filter: torchrun's traceback for a rendezvous that timed out becomes one line.

    torchrun ... 2> >(python3 -m hybrid.rdzv_timeout "multinode.sh: error: timed out ..." >&2)

When not every node joins within `join_timeout`, the torchrun agent ends with a traceback of some thirty
lines whose last one is `torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError`; the user is
better served by one line saying what did not happen. The workers share the agent's stderr, so the
filter passes everything through byte for byte and at once, except a Python traceback: from its
`Traceback (most recent call last):` line to its exception line it is held, then written out unchanged
unless that exception is the rendezvous timeout, which the given line replaces. A held traceback is let
go after `HOLD_S` of silence too, so nothing waits on the filter longer than that. Nothing collective.

The filter ignores SIGINT, SIGTERM and SIGHUP and ends when every writer has closed the pipe: a Ctrl-C
or a scheduler's SIGTERM reaches torchrun and its workers, which then still have a stderr to write their
last lines (a save on SIGTERM) to.
"""

from __future__ import annotations

import os
import select
import signal
import sys

START = b"Traceback (most recent call last):"
CHAINED = (b"During handling of the above exception", b"The above exception was the direct cause")
TIMEOUT = b"torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"
HOLD_S = 0.5


class Filter:
    """`feed(bytes)` → the bytes to write now; `release()` → what is held (at EOF or after HOLD_S)."""

    def __init__(self, line: str) -> None:
        self.line = line.encode() + b"\n"
        self.pending = b""  # the current line's bytes, while they may still begin a traceback
        self.mid_line = False  # part of the current line is out: the rest of it passes through
        self.held: list[bytes] = []  # a traceback's complete lines

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            cut = data.find(b"\n") + 1 or len(data)
            out.append(self._piece(data[:cut]))
            data = data[cut:]
        return b"".join(out)

    def _piece(self, piece: bytes) -> bytes:
        """One line, or the unfinished start of one (no newline)."""
        if self.mid_line:
            self.mid_line = not piece.endswith(b"\n")
            return piece
        text = self.pending + piece
        if not text.endswith(b"\n"):
            return self._unfinished(text)
        self.pending = b""
        return self._line(text)

    def _unfinished(self, text: bytes) -> bytes:
        """Hold what may begin a traceback (or is inside one); let anything else out at once."""
        if self.held or START.startswith(text.rstrip(b"\r")):
            self.pending = text
            return b""
        self.pending, self.mid_line = b"", True
        return text

    def _line(self, line: bytes) -> bytes:
        bare = line.rstrip(b"\r\n")
        if bare == START or (self.held and (bare[:1] in (b" ", b"\t", b"") or bare.startswith(CHAINED))):
            self.held.append(line)
            return b""
        if not self.held:
            return line
        block, self.held = b"".join(self.held), []
        return self.line if bare.startswith(TIMEOUT) else block + line

    def release(self) -> bytes:
        """Let out what is held; an unfinished line let out makes the rest of that line pass through."""
        out, self.mid_line = b"".join(self.held) + self.pending, bool(self.pending)
        self.held, self.pending = [], b""
        return out


def run(line: str, fd_in: int = 0, fd_out: int = 1) -> None:
    """Copy `fd_in` to `fd_out` through a Filter until end of file."""
    f = Filter(line)
    while True:
        holding = bool(f.held or f.pending)
        if holding and not select.select([fd_in], [], [], HOLD_S)[0]:
            _write(fd_out, f.release())
            continue
        data = os.read(fd_in, 65536)
        _write(fd_out, f.feed(data) if data else f.release())
        if not data:
            return


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    run(sys.argv[1] if len(sys.argv) > 1 else "error: the rendezvous timed out")


if __name__ == "__main__":
    main()
