"""Save on a signal: a preempted run saves the step it reached, exits cleanly, and resumes to the loss curve of
an uninterrupted run (conftest's `tiny_reference`: the same settings with checkpoints every 2 steps, which change
no number of the run).

- SIGUSR1 to ONE rank of `hybrid.train.main` run as 2 ranks forked from this process (hybrid.testing.cli_runs),
  sent by a thread of this process to rank 1's pid once step 3 is logged: both ranks agree at the next step
  boundary, save that step, rank 0 logs one line, and both exit 0. Then `checkpoint.resume=auto` (forked too)
  finishes the run; every step is logged once and the losses, gradient norms and eval losses equal the
  uninterrupted run's bit for bit (fp32 on CPU, dropout on).
- SIGTERM to the real torchrun agent (the usual preemption): the agent forwards it to the workers, which save
  and exit 0 (its report names no failed worker); the agent itself exits non-zero (torch re-raises the signal
  as SignalException).

In the signalled runs rank 1 holds at the start of step HOLD until the signal has reached it (killer.py's
`hold`), so the save lands at step HOLD − 1 or HOLD however fast the machine runs the steps; the resumed run is
plain `hybrid.train`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import killer
import pytest
from test_fault_tolerance import RUN, TORCHRUN, dirs, killer_env
from test_torchrun import ROOT, TINY, forked, output, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.checkpoint import find_latest, list_steps, problem, step_path
from hybrid.testing.cli_runs import run_forked_ranks

pytestmark = pytest.mark.slow

STEPS = 8
HOLD = 4  # rank 1 waits at the start of this step until the signal has reached it
ARGS = [*TINY, f"train.steps={STEPS}", "checkpoint.every=0"]
TIMEOUT = 240
SAVED = re.compile(r"checkpoint: saved step (\d+) on (SIG\w+); exiting \(resume with checkpoint\.resume=auto\)")


def start(tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    """torchrun (2 ranks) in its own session, so a timeout can kill the agent and its workers together; through
    killer.py, rank 1 holding at the start of step HOLD until it has caught a signal."""
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0", "-m", "killer", *ARGS, *dirs(tmp)]
    return subprocess.Popen(cmd, cwd=ROOT, env=killer_env(env, f"hold:{HOLD}"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def signal_after(run_dir: Path, step: int, pid_file: Path, sig: signal.Signals, done: threading.Event) -> None:
    """In a thread of this process, started before the ranks are forked (a child inherits no thread): once
    metrics.jsonl has `step`, send `sig` to the pid in `pid_file`, once; give up when `done` is set."""
    def send() -> None:
        while not done.wait(0.02):
            if steps_logged(run_dir) >= step:
                os.kill(int(pid_file.read_text()), sig)
                return

    threading.Thread(target=send, name="signal_after", daemon=True).start()


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"timed out after {TIMEOUT} s:\n{p.communicate()[0][-3000:]}")
    return p.returncode, out


def steps_logged(run_dir: Path) -> int:
    """The last step in metrics.jsonl so far (its complete lines only: rank 0 may be writing one)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    except FileNotFoundError:
        return 0
    return max([json.loads(line)["step"] for line in lines if '"loss"' in line], default=0)


def wait_for_step(p: subprocess.Popen, run_dir: Path, step: int) -> None:
    """Until metrics.jsonl has a record of `step` (or later); fails if torchrun exits first."""
    deadline = time.monotonic() + TIMEOUT
    while steps_logged(run_dir) < step:
        if p.poll() is not None or time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"torchrun ended ({p.poll()}) or timed out before step {step}:\n{p.communicate()[0][-3000:]}")
        time.sleep(0.02)


def saved(out: str, sig: str, tmp: Path) -> int:
    """The step of the one save-on-signal line in `out`; checks the checkpoint is complete and the newest."""
    lines = SAVED.findall(out)
    assert len(lines) == 1 and lines[0][1] == sig, out[-4000:]
    step = int(lines[0][0])
    root = tmp / "ck" / RUN
    assert HOLD - 1 <= step <= HOLD  # the boundary after the logged step, or after the held one
    assert [s for s, _ in list_steps(root)] == [step] and problem(step_path(root, step)) is None
    assert find_latest(root, print) == step_path(root, step)
    assert [s["step"] for s in read_metrics(tmp / "run")[0]] == list(range(1, step + 1))
    return step


def test_sigusr1_to_one_rank_saves_exits_0_and_resumes_bit_exact(tmp_path: Path, forking: dict[str, str],
                                                                  tiny_reference: Any) -> None:
    (tmp_path / "pids").mkdir()
    done = threading.Event()
    # rank 1 only: rank 0 learns of it through the per-step all_reduce
    signal_after(tmp_path / "run", HOLD - 1, tmp_path / "pids" / "1", signal.SIGUSR1, done)
    env = {**forking, "HYBRID_KILL": f"hold:{HOLD}", "HYBRID_KILL_RANK": "1"}
    try:
        runs = run_forked_ranks(functools.partial(killer.main, tmp_path / "pids"), [*ARGS, *dirs(tmp_path)],
                                tmp_path, 2, env, timeout_s=TIMEOUT)
    finally:
        done.set()
    assert [r.code for r in runs] == [0, 0], output(runs)[-4000:]
    step = saved(output(runs), "SIGUSR1", tmp_path)

    runs = forked(2, *ARGS, *dirs(tmp_path), "checkpoint.resume=auto", cwd=tmp_path, env=forking)
    assert [r.code for r in runs] == [0, 0], output(runs)[-4000:]
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, step)} at step {step}" in output(runs)
    steps, evals = read_metrics(tmp_path / "run")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    reference = tiny_reference.steps, tiny_reference.evals
    assert [e["step"] for e in evals] == [e["step"] for e in reference[1]] == [4, 8]
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference[0]]
    assert [s["grad_norm"] for s in steps] == [s["grad_norm"] for s in reference[0]]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in reference[1]]


def test_sigterm_to_the_agent_saves_on_every_rank(tmp_path: Path, env: dict[str, str]) -> None:
    p = start(tmp_path, env)
    wait_for_step(p, tmp_path / "run", HOLD - 1)
    os.kill(p.pid, signal.SIGTERM)  # the agent sends SIGTERM to both workers and waits for them
    rc, out = finish(p)
    assert rc != 0 and "SignalException" in out  # torchrun re-raises the signal it got ...
    assert "ChildFailedError" not in out  # ... while its workers exited 0
    saved(out, "SIGTERM", tmp_path)
