"""Memory of the processes a benchmark starts, read from /proc: a rank's peak, every descendant's, and a
watch that kills the ranks before a shared machine runs out of memory."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

LOW_MEMORY_KB = 2**20  # the ranks are killed when MemAvailable falls below 1 GiB (the machine is shared)


def proc_status_kb(status: str, key: str) -> int:
    """The kB figure of `key` (VmHWM, VmRSS) in a /proc/<pid>/status text; 0 when absent."""
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_mib(key: str = "VmRSS") -> float:
    """This process's resident set (or VmHWM: its peak) in MiB."""
    return proc_status_kb(Path("/proc/self/status").read_text(), key) / 1024


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def sample_peaks(pid: int, stop: threading.Event, peaks: dict[str, int], period: float = 0.5,
                 on_low_memory: Optional[Callable[[], None]] = None, low_kb: int = 2**20) -> None:
    """Until `stop`: peaks[RANK of each descendant] = max VmHWM kB, peaks["total"] = max sum of their VmRSS kB,
    peaks["min_available"] = least MemAvailable kB; calls `on_low_memory` once MemAvailable < `low_kb`."""
    while not stop.wait(period):
        total = 0
        for child in descendants(pid):
            try:
                status = Path(f"/proc/{child}/status").read_text()
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
            total += proc_status_kb(status, "VmRSS")
            if rank is not None:
                peaks[rank] = max(peaks.get(rank, 0), proc_status_kb(status, "VmHWM"))
        peaks["total"] = max(peaks.get("total", 0), total)
        available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable")
        peaks["min_available"] = min(peaks.get("min_available", available), available)
        if on_low_memory is not None and available < low_kb:
            on_low_memory()
            on_low_memory = None


class MemoryWatch:
    """Samples the ranks' summed RSS and the machine's MemAvailable while ranks run; kills this process's
    descendants (by pid) if MemAvailable falls below LOW_MEMORY_KB, so a shared machine is not pushed to OOM."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()
        self.killed = False
        self.thread = threading.Thread(target=sample_peaks, args=(os.getpid(), self.stop, self.peaks, 0.25,
                                                                  self._kill, LOW_MEMORY_KB), daemon=True)

    def _kill(self) -> None:
        self.killed = True
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> MemoryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        if self.killed:
            raise MemoryError(f"MemAvailable fell below {LOW_MEMORY_KB // 1024} MiB: the ranks were killed")

    def line(self) -> str:
        total, avail = self.peaks.get("total", 0) / 2**20, self.peaks.get("min_available", 0) / 2**20
        return (f"ranks' summed RSS peak {total:.2f} GiB (shared pages counted per rank), "
                f"least MemAvailable {avail:.2f} GiB")
