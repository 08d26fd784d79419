"""`hybrid-commbench --soak DURATION`: a new cluster's acceptance test. Every chosen op over every chosen group kind,
back to back at the largest size (-e), for DURATION seconds: each round calls each (group kind, op) once, so every
link and every collective stays busy for the whole time. Counted per (group kind, op): calls, wrong results (every
`CHECK_EVERY`-th round is compared with the expected values, as the tables' #wrong column), errors (a collective
that raised: a timeout under `--timeout`, a lost peer; the soak ends at the first, since a process group that
failed cannot be trusted), and the slowest calls — the round, the time into the soak, the rank that took longest.

A call's time is the slowest rank's (the link is as fast as its slowest end); the figures are gathered once, at the
end (one all-gather over the world of every rank's times). Rank 0 decides when the time is up and tells the others
at the end of each round (a one-element broadcast), so every rank makes the same calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import bandwidth as bw
from .report import size_text

CHECK_EVERY = 10  # rounds between correctness checks (a check recomputes the expected values: costly)
SLOWEST = 3  # slowest calls listed per (group kind, op)


@dataclass(frozen=True)
class Slow:
    round: int
    at_s: float  # seconds into the soak
    ms: float
    rank: int  # the rank that took longest


@dataclass(frozen=True)
class SoakLine:
    kind: str
    op: str
    size: int  # bytes per call
    calls: int
    median_ms: float
    p99_ms: float
    max_ms: float
    busbw: float  # GB/s at the median call
    slowest: tuple[Slow, ...]
    wrong: int
    errors: int


@dataclass(frozen=True)
class Soak:
    lines: list[SoakLine]
    rounds: int
    seconds: float
    error: str  # the first collective's error ('' when none)

    @property
    def failed(self) -> bool:
        return bool(self.error) or any(line.wrong for line in self.lines)


def soak(sets: Sequence[bw.GroupSet], ops: Sequence[str], size: int, dtype: torch.dtype, device: torch.device,
         duration_s: float, check: bool = True, clock: Callable[[], float] = time.monotonic) -> Soak:
    """Run the soak (see the module doc). Collective over the world: every rank calls it alike."""
    pairs = [(g, op) for g in sets for op in ops]
    times: list[list[float]] = [[] for _ in pairs]
    wrong, starts, error, failed, start = [0] * len(pairs), [], "", -1, clock()
    while not error and _go_on(clock() - start < duration_s, device):
        starts.append(clock() - start)
        for i, (g, op) in enumerate(pairs):
            try:
                times[i].append(_timed(op, g, size, dtype, device))
                if check and len(starts) % CHECK_EVERY == 1:
                    wrong[i] += bw.check_call(op, g.member(), _count(op, g, size, dtype), dtype, device, False)
            except RuntimeError as e:  # a timeout or a lost peer: the group cannot be trusted any more
                error, failed = f"{g.kind} {op}, round {len(starts)}: {str(e).splitlines()[0]}", i
                break
    return _summary(pairs, times, wrong, starts, size, (error, failed), clock() - start, device)


def _go_on(mine: bool, device: torch.device) -> bool:
    """Rank 0's answer on every rank (a one-element broadcast): the same number of rounds everywhere."""
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _count(op: str, g: bw.GroupSet, size: int, dtype: torch.dtype) -> int:
    return bw.element_count(op, size, g.size, torch.empty(0, dtype=dtype).element_size())


def _timed(op: str, g: bw.GroupSet, size: int, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of one out-of-place call of `op` over this rank's group of `g` (fresh buffers: a fair first touch)."""
    m = g.member()
    b = bw.buffers(op, m.me, m.size, _count(op, g, size, dtype), dtype, device, False)
    bw.synchronize(device)
    t0 = time.perf_counter()
    bw.call(op, b, m, False)
    bw.synchronize(device)
    return time.perf_counter() - t0


def _summary(pairs: list[tuple[bw.GroupSet, str]], times: list[list[float]], wrong: list[int], starts: list[float],
             size: int, fault: tuple[str, int], seconds: float, device: torch.device) -> Soak:
    """Every rank's times and counts gathered (one all-gather); each call's time is its slowest rank's. After an
    error (`fault`: its line and the failing pair's index) the group cannot gather: this rank's own figures then
    (rank 0's are printed)."""
    error, failed = fault
    rounds = min(map(len, times), default=0)  # an error ends the last round early on some (group kind, op)
    local = [t for ts in times for t in ts[:rounds]] + [float(w) for w in wrong]
    every = torch.tensor([local], dtype=torch.float64) if error else bw.gather_world(local, device)
    lines = []
    for i, (g, op) in enumerate(pairs):
        per_rank = every[:, i * rounds:(i + 1) * rounds]  # [world, rounds]
        slowest, who = per_rank.max(dim=0) if rounds else (torch.zeros(0), torch.zeros(0))
        lines.append(_line(g, op, size, slowest.tolist(), who.tolist(), starts,
                           int(every[:, len(pairs) * rounds + i].sum()), int(i == failed)))
    return Soak(lines, rounds, seconds, error)


def _line(g: bw.GroupSet, op: str, size: int, call_s: list[float], who: list[int], starts: list[float], wrong: int,
          errors: int) -> SoakLine:
    ms = sorted(t * 1e3 for t in call_s)
    worst = sorted(range(len(call_s)), key=lambda r: -call_s[r])[:SLOWEST]
    slow = tuple(Slow(r + 1, starts[r], call_s[r] * 1e3, int(who[r])) for r in worst)
    median = statistics.median(ms) if ms else 0.0
    return SoakLine(g.kind, op, size, len(ms), median, _p99(ms), ms[-1] if ms else 0.0,
                    bw.busbw(op, g.size, size, median / 1e3) if median else 0.0, slow, wrong, errors)


def _p99(ms: list[float]) -> float:
    return ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else 0.0


def render(result: Soak, world: int, backend: str, device: torch.device, duration_s: float, check: bool = True) -> str:
    """The soak's report (rank 0 prints it)."""
    checked = f"results checked every {CHECK_EVERY}th round" if check else "results not checked (-c 0)"
    head = (f"# hybrid-commbench --soak {duration_s:g} s: world {world} ({backend} on {device.type}), {result.rounds} "
            f"rounds in {result.seconds:.1f} s; a call's time is its slowest rank's; {checked}")
    cols = ("#  group      op                 size  calls  median ms   p99 ms   max ms  busbw GB/s  wrong  errors  "
            "slowest")
    rows = [f"   {x.kind:<10} {x.op:<14} {size_text(x.size):>9} {x.calls:>6} {x.median_ms:>10.3f} {x.p99_ms:>8.3f} "
            f"{x.max_ms:>8.3f} {x.busbw:>11.3f} {x.wrong:>6} {x.errors:>7}  "
            + ", ".join(f"round {s.round} at {s.at_s:.1f} s: {s.ms:.2f} ms (rank {s.rank})" for s in x.slowest)
            for x in result.lines]
    verdict = (f"# FAILED: {result.error}" if result.error else
               f"# FAILED: {sum(x.wrong for x in result.lines)} wrong element(s)" if result.failed else
               "# passed: no wrong result, no error")
    return "\n".join([head, cols, *rows, verdict])

