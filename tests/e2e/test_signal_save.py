"""Save on a signal with the real torchrun: a preempted run saves the step it reached, exits cleanly,
and resumes to the loss curve of an uninterrupted run (conftest's `tiny_reference`: the same settings with
checkpoints every 2 steps, which change no number of the run).

- SIGUSR1 to ONE worker (rank 1's pid, found under /proc as the torchrun agent's child whose
  environment says RANK=1) once step 3 is logged: both ranks agree at the next step boundary, save that
  step, rank 0 logs one line, and torchrun exits 0 (no restart: every worker exited 0). Then
  `checkpoint.resume=auto` finishes the run; every step is logged once and the losses, gradient
  norms and eval losses equal the uninterrupted run's bit for bit (fp32 on CPU, dropout on).
- SIGTERM to the torchrun agent (the usual preemption): the agent forwards it to the workers, which
  save and exit 0; the agent itself exits non-zero (torch re-raises the signal as SignalException).

In the signalled runs rank 1 holds at the start of step HOLD until the signal has reached it (killer.py's
`hold`), so the save lands at step HOLD − 1 or HOLD however fast the machine runs the steps; the resumed runs
are plain `hybrid.train`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_fault_tolerance import RUN, TORCHRUN, dirs, killer_env
from test_torchrun import ROOT, TINY, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.checkpoint import find_latest, list_steps, problem, step_path

pytestmark = pytest.mark.slow

STEPS = 8
HOLD = 4  # rank 1 waits at the start of this step until the signal has reached it
ARGS = [*TINY, f"train.steps={STEPS}", "checkpoint.every=0"]
TIMEOUT = 240
SAVED = re.compile(r"checkpoint: saved step (\d+) on (SIG\w+); exiting \(resume with checkpoint\.resume=auto\)")


def start(tmp: Path, env: dict[str, str], *extra: str, hold: bool = False) -> subprocess.Popen:
    """torchrun (2 ranks) in its own session, so a timeout can kill the agent and its workers together; `hold`:
    through killer.py, rank 1 holding at the start of step HOLD until it has caught a signal."""
    module, env = (["-m", "killer"], killer_env(env, f"hold:{HOLD}")) if hold else (["-m", "hybrid.train"], env)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0", *module, *ARGS, *dirs(tmp), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"timed out after {TIMEOUT} s:\n{p.communicate()[0][-3000:]}")
    return p.returncode, out


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of the agent's child process whose environment has RANK=`rank` (from /proc)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (d / "environ").read_bytes().split(b"\0") if ppid == agent else []
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if f"RANK={rank}".encode() in environ:
            return int(d.name)
    return None


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


def test_sigusr1_to_one_rank_saves_exits_0_and_resumes_bit_exact(tmp_path: Path, env: dict[str, str],
                                                                  tiny_reference: Any) -> None:
    p = start(tmp_path, env, hold=True)
    wait_for_step(p, tmp_path / "run", HOLD - 1)
    pid = worker_pid(p.pid, 1)
    assert pid is not None, "rank 1's process not found under /proc"
    os.kill(pid, signal.SIGUSR1)  # rank 1 only: rank 0 learns of it through the per-step all_reduce
    rc, out = finish(p)
    assert rc == 0, out[-4000:]
    step = saved(out, "SIGUSR1", tmp_path)

    rc, out = finish(start(tmp_path, env, "checkpoint.resume=auto"))
    assert rc == 0, out[-4000:]
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, step)} at step {step}" in out
    steps, evals = read_metrics(tmp_path / "run")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    reference = tiny_reference.steps, tiny_reference.evals
    assert [e["step"] for e in evals] == [e["step"] for e in reference[1]] == [4, 8]
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference[0]]
    assert [s["grad_norm"] for s in steps] == [s["grad_norm"] for s in reference[0]]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in reference[1]]


def test_sigterm_to_the_agent_saves_on_every_rank(tmp_path: Path, env: dict[str, str]) -> None:
    p = start(tmp_path, env, hold=True)
    wait_for_step(p, tmp_path / "run", HOLD - 1)
    os.kill(p.pid, signal.SIGTERM)  # the agent sends SIGTERM to both workers and waits for them
    rc, out = finish(p)
    assert rc != 0 and "SignalException" in out  # torchrun re-raises the signal it got ...
    assert "ChildFailedError" not in out  # ... while its workers exited 0
    saved(out, "SIGTERM", tmp_path)
