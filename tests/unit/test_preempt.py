"""Save-on-signal's flag and the ranks' agreement on it (`hybrid.checkpoint.preempt`), on 2 forked gloo ranks.

A signal raised on rank 1 only, through the installed handler, stops both ranks at the same step;
two different signals agree on the higher number; an empty `save_on_signal` runs no collective;
leaving the context puts the previous handlers back; names are checked.
"""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from hybrid.checkpoint.preempt import REPEAT_S, Preemption, parse_signals
from hybrid.config import ConfigError
from hybrid.testing.ranks import launch

CPU = torch.device("cpu")


def _stop_step(rank: int, raise_at: dict[int, signal.Signals]) -> tuple[int, str, int]:
    """Steps 1..9 with the flag checked at each boundary; rank r raises `raise_at[r]` in step 3 (+r)."""
    with Preemption(["SIGTERM", "SIGUSR1"], CPU) as p:
        for step in range(1, 10):
            if rank in raise_at and step == 3 + rank:
                signal.raise_signal(raise_at[rank])  # the real handler runs before raise_signal returns
            sig = p.agreed()
            if sig is not None:
                return step, sig.name, p.caught
    return 0, "", p.caught


def _agreement_rank(rank: int, world: int) -> dict[str, object]:
    before = signal.getsignal(signal.SIGUSR1)
    one = _stop_step(rank, {1: signal.SIGUSR1})
    restored = signal.getsignal(signal.SIGUSR1) is before and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    both = _stop_step(rank, {0: signal.SIGTERM, 1: signal.SIGUSR1})
    if rank == 0:  # an empty list: no collective, so the next all_reduce still pairs with rank 1's
        assert Preemption([], CPU).agreed() is None
    marker = torch.tensor([rank + 10])
    dist.all_reduce(marker)
    return {"one": one, "restored": restored, "both": both, "marker": int(marker)}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step() -> None:
    r0, r1 = launch(_agreement_rank, 2, timeout=120)
    assert r0["one"] == (4, "SIGUSR1", 0) and r1["one"] == (4, "SIGUSR1", signal.SIGUSR1)  # raised in step 4
    assert r0["restored"] and r1["restored"]
    # rank 0 caught SIGTERM in step 3, rank 1 nothing yet: both stop at 3; the higher number wins
    assert r0["both"] == (3, "SIGTERM", signal.SIGTERM) and r1["both"] == (3, "SIGTERM", 0)
    assert r0["marker"] == r1["marker"] == 10 + 11


def test_signal_names() -> None:
    assert parse_signals(["SIGTERM", "usr1", "SIGUSR1"]) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals([]) == ()
    for bad in ("SIGKILL", "SIGSTOP", "NOPE"):
        with pytest.raises(ConfigError, match=f"save_on_signal: '{bad}' is not a signal a process can catch"):
            parse_signals([bad])


def test_single_process_sees_its_own_signal() -> None:
    with Preemption(["SIGUSR1"], CPU) as p:
        assert p.agreed() is None
        signal.raise_signal(signal.SIGUSR1)
        assert p.agreed() is signal.SIGUSR1
    assert Preemption(["SIGUSR1"], CPU).agreed() is None  # a fresh flag


def _insist(second: signal.Signals, later_s: float) -> None:
    """SIGUSR1, then `second` as if `later_s` seconds had passed (the first catch's time moved back)."""
    with Preemption(["SIGUSR1", "SIGTERM"], CPU) as p:
        signal.raise_signal(signal.SIGUSR1)  # the first: a flag only
        p.caught_at -= later_s
        signal.raise_signal(second)  # a second request: the default action ends the process
    raise SystemExit(0)


@pytest.mark.parametrize("second, later_s, exitcode", [
    (signal.SIGUSR1, 0.0, 0),  # the same signal at once: one request delivered twice (srun torchrun under Slurm)
    (signal.SIGUSR1, 10 * REPEAT_S, -signal.SIGUSR1),  # the same one, far later: a user insisting
    (signal.SIGTERM, 0.0, -signal.SIGTERM)])  # another signal: a second request, however soon
def test_a_second_signal_ends_the_process_at_once(second: signal.Signals, later_s: float, exitcode: int) -> None:
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=_insist, args=(second, later_s))
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == exitcode
