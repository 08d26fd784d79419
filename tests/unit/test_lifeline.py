"""hybrid.lifeline's decisions, without arming this test process: only under torchrun, the race (a parent
already gone when arming) ends the process at once, and the watchdog where there is no prctl."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from hybrid import lifeline

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """What hold did: ("prctl", sig) and ("kill", sig) in order; nothing reaches the kernel."""
    calls: list[object] = []
    monkeypatch.setattr(lifeline, "set_death_signal", lambda sig: calls.append(("prctl", sig)))
    monkeypatch.setattr(lifeline.os, "kill", lambda pid, sig: calls.append(("kill", sig)))
    monkeypatch.setattr(lifeline, "POLL_S", 0.001)
    yield calls


def parents(monkeypatch: pytest.MonkeyPatch, *pids: int) -> None:
    """os.getppid() answers `pids` in turn, then the last one forever."""
    answers = iter(pids)
    monkeypatch.setattr(lifeline.os, "getppid", lambda: next(answers, pids[-1]))


def test_only_under_torchrun(seen: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifeline.sys, "platform", "linux")
    lifeline.hold({"RANK": "0", "LOCAL_RANK": "0"})  # a forked test rank, or python -m hybrid.train
    assert seen == []
    parents(monkeypatch, 40, 40)
    lifeline.hold(TORCHRUN)
    assert seen == [("prctl", signal.SIGKILL)]


def test_a_parent_gone_before_arming_ends_the_process(seen: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifeline.sys, "platform", "linux")
    parents(monkeypatch, 40, 1)  # adopted by init between the two reads
    lifeline.hold(TORCHRUN)
    assert seen == [("prctl", signal.SIGKILL), ("kill", signal.SIGKILL)]


def test_without_prctl_a_watchdog_kills_on_reparenting(seen: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[object, ...]] = []

    class Thread:  # records what hold would start: a real watchdog would outlive the monkeypatches
        def __init__(self, target: object, args: tuple[object, ...], name: str, daemon: bool) -> None:
            started.append((target, args, name, daemon))

        def start(self) -> None:
            pass

    monkeypatch.setattr(lifeline.sys, "platform", "darwin")
    monkeypatch.setattr(lifeline.threading, "Thread", Thread)
    parents(monkeypatch, 40)
    lifeline.hold(TORCHRUN)
    assert started == [(lifeline._watch, (40,), "lifeline", True)] and seen == []
    parents(monkeypatch, 40, 40, 40, 1)
    lifeline._watch(40)  # the watchdog's loop, here on this thread: returns once it has sent the signal
    assert seen == [("kill", signal.SIGKILL)]
