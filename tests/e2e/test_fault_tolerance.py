"""Fault tolerance with the real torchrun: a rank SIGKILLed mid-save, or hung, and the run still ends with the
loss curve of an uninterrupted run, each step logged once.

- The reference: conftest's `tiny_reference`, 2 ranks (dp2), 8 steps, a checkpoint every 2 steps, keep 2.
- One launch meets two faults in a row (killer.py, one fault per attempt, always rank 1): `launch/local.sh`
  with its defaults (`--max-restarts=3`, `checkpoint.resume=auto`, a fresh TCPStore per attempt) runs
  `killer.py`, and torchrun restarts both ranks after each fault:
  1. SIGKILL while writing its shard of step 4 (mid-run, mid-save): that folder has no `.metadata`, so the
     restart skips it with a warning saying so (`problem()`), resumes step 2 by itself and saves step 4 anew;
  2. a hang at the start of step 6: rank 0's collective times out after `parallel.train_timeout_s`, it exits with
     the one line naming the group (and no traceback) and writes its flight recorder; the hung rank writes
     none; the last restart resumes step 4, the newest checkpoint (complete: no warning), and finishes. (The
     hang comes last: rank 0 also writes a flight recorder when a peer dies, so a later fault would overwrite
     the hang's.)
  Each test below reads one part of that launch's output; the last compares its metrics with the reference.
  (tests/e2e/test_hangs.py stops a rank with SIGSTOP in a forked run, tests/e2e/test_elastic.py resumes on
  another number of ranks.)
- The launch scripts' defaults, checked without starting anything (`TORCHRUN=echo`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_torchrun import ROOT, TINY, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.checkpoint import METADATA, list_steps, problem, step_path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RUN = "gpt-tiny-dp"  # run_name of the default model and parallel groups
TIMEOUT = 240
FAULTS = "save:4,hang:6"  # attempt 0, 1 (killer.py); attempt 2 runs clean
# parallel.train_timeout_s: far above a step's collectives (milliseconds), so only the hang trips it.
# parallel.timeout_s bounds the start-up (the TCPStore, the process group, the first step), the saves and the
# evaluations: on a loaded machine (the suite beside a benchmark) a rank's start-up wait for its peers took over
# 10 s, ending attempt 0 before its fault
HANG_TIMEOUT_S = 10
START_TIMEOUT_S = 90


def run(cmd: list[str], env: dict[str, str], timeout: int = TIMEOUT, merge: bool = False
        ) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; on timeout kill its whole process group (torchrun and its ranks). `merge`:
    stderr into stdout, one pipe, so the lines of all attempts and ranks keep the order they were written in."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{(err or out)[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err or "")


def dirs(tmp: Path) -> list[str]:
    return [f"checkpoint.dir={tmp / 'ck'}", f"logging.dir={tmp / 'run'}"]


def killer_env(env: dict[str, str], kill: str) -> dict[str, str]:
    return {**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'e2e'}", "HYBRID_KILL": kill, "HYBRID_KILL_RANK": "1"}


def folders(tmp: Path) -> dict[str, str | None]:
    """step folder name → problem() (None: complete and loadable)."""
    return {p.name: problem(p) for _, p in list_steps(tmp / "ck" / RUN)}


def latest(tmp: Path) -> str:
    return os.readlink(tmp / "ck" / RUN / "latest")


def resumed(tmp: Path, step: int) -> str:
    return f"checkpoint: resumed {step_path(tmp / 'ck' / RUN, step)} at step {step}"


def after(out: str, *needles: str) -> int:
    """Where the last of `needles` starts, each found after the one before it (fails on the first missing)."""
    at = 0
    for needle in needles:
        found = out.find(needle, at)
        assert found >= 0, f"{needle!r} not after position {at}:\n{out[at:][-4000:]}"
        at = found
    return at


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> tuple[Path, str]:
    """The launch meeting FAULTS: (its folder, everything it printed in order); it must end with status 0."""
    tmp = tmp_path_factory.mktemp("faulted")
    # HYBRID_CHECK=0: no check before launch (one more fresh Python; tests/e2e/test_bad_inputs.py runs it)
    e = killer_env(env, FAULTS) | {"TORCHRUN": " ".join(TORCHRUN), "HYBRID_MODULE": "killer", "PYTHONUNBUFFERED": "1",
                                   "HYBRID_CHECK": "0"}
    e.pop("MAX_RESTARTS", None)
    r = run(["bash", str(ROOT / "launch" / "local.sh"), "2", *TINY, *dirs(tmp),
             f"parallel.timeout_s={START_TIMEOUT_S}", f"parallel.train_timeout_s={HANG_TIMEOUT_S}"], e, merge=True)
    assert r.returncode == 0, r.stdout[-4000:]
    return tmp, r.stdout


def test_each_fault_restarts_both_ranks_once(faulted: tuple[Path, str]) -> None:
    attempts = sorted(re.findall(r"killer: attempt (\d+) rank (\d+)", faulted[1]))
    assert attempts == [(str(a), str(r)) for a in range(3) for r in range(2)]  # 2 faults, 2 restarts of both


def test_rank_killed_mid_save_restarts_and_resumes_the_previous_checkpoint(faulted: tuple[Path, str]) -> None:
    """Rank 1 SIGKILLed while writing its shard of step 4: torchrun restarts both ranks, which skip the incomplete
    step 4 (one warning) and resume step 2 by themselves."""
    tmp, out = faulted
    partial = step_path(tmp / "ck" / RUN, 4)
    killed = f"killer: SIGKILL rank 1 mid-write of {partial}"
    assert out.count(killed) == 1 and out.count(resumed(tmp, 2)) == 1
    warning = f"hybrid: warning: checkpoint {partial} is incomplete: {METADATA} is missing (the save did not finish)"
    assert out.count("warning: checkpoint") == 1 and out.count(f"{warning}; skipping it") == 1  # attempt 1
    after(out, "killer: attempt 0 rank 1", killed, "killer: attempt 1", warning, resumed(tmp, 2))


def test_rank_hung_mid_run_is_timed_out_restarted_and_resumes(faulted: tuple[Path, str]) -> None:
    """A hung rank (silent at step 6): rank 0's collective times out after parallel.train_timeout_s, it exits with the
    one line naming the group, no traceback, and writes its flight recorder (the hung rank none); torchrun ends
    the hung rank, restarts both, they resume step 4."""
    tmp, out = faulted
    assert out.count("killer: hang rank 1 at the start of step 6") == 1
    hung = after(out, "killer: attempt 1 rank 1", "killer: hang rank 1 at the start of step 6")
    at = after(out[hung:], "[rank0] hybrid: error: collective") + hung
    line = out[at:].splitlines()[0]
    assert re.search(r"on the (dp|world) group \(ranks \[0, 1\]\) failed (in|after) step \d+: ", line), line
    flight = tmp / "run" / "flight" / "rank0.txt"
    assert f"parallel.train_timeout_s={HANG_TIMEOUT_S} s" in line and f"last collectives: {flight}" in line
    assert "Traceback" not in out[hung:at] and out[at:].count("hybrid: error:") == 1, out[hung:][-4000:]
    recorder = flight.read_text()
    assert "flight recorder of rank 0" in recorder and re.search(r" (dp|world) .* (running|failed)\n", recorder)
    assert sorted(p.name for p in flight.parent.iterdir()) == ["rank0.txt"]  # rank 1 wrote none, in no attempt
    after(out, line, "killer: attempt 2", resumed(tmp, 4))
    assert out.count(resumed(tmp, 4)) == 1


def test_the_faulted_run_ends_as_the_uninterrupted_one(faulted: tuple[Path, str], tiny_reference: Any) -> None:
    """Each step (and eval) logged exactly once, and the loss curve bit-equal to the reference's."""
    tmp = faulted[0]
    steps, evals = read_metrics(tmp / "run")
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert [e["step"] for e in evals] == [4, 8]
    assert [s["loss"] for s in steps] == [s["loss"] for s in tiny_reference.steps]
    assert [s["grad_norm"] for s in steps] == [s["grad_norm"] for s in tiny_reference.steps]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in tiny_reference.evals]
    # keep=2 keeps steps 6 and 8, and also step 4: the checkpoint the last attempt resumed from
    assert folders(tmp) == {"step_0000004": None, "step_0000006": None, "step_0000008": None}
    assert latest(tmp) == "step_0000008"
    assert folders(tiny_reference.tmp) == {"step_0000006": None, "step_0000008": None}
    assert latest(tiny_reference.tmp) == "step_0000008"


# ---- the launch scripts' defaults, without launching (TORCHRUN=echo, srun and scontrol faked) ----

def launch(script: str, args: list[str], tmp: Path, **extra: str) -> list[str]:
    """The argument list `script` hands to torchrun, after `share=<TORCH_DISABLE_SHARE_RDZV_TCP_STORE>`."""
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "torchrun").write_text('#!/bin/sh\necho "share=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" "$@"\n')
    (fake / "srun").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # drop --kill-on-bad-exit=1
    (fake / "scontrol").write_text("#!/bin/sh\necho node-a\necho node-b\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    # 2 nodes x 2 ranks under each script: a world the arguments fit (each script checks them before torchrun)
    e = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2",
         "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_SUBMIT_DIR": str(ROOT), **extra}
    pre = {"local.sh": ["2"], "multinode.sh": ["--nnodes", "2", "--endpoint", "h:1"], "slurm.sbatch": []}[script]
    r = subprocess.run(["bash", str(ROOT / "launch" / script), *pre, *args], capture_output=True, text=True,
                       timeout=30, env=e)
    if r.returncode != 0:
        return ["exit", str(r.returncode), *r.stderr.strip().splitlines()]
    return r.stdout.splitlines()[-1].split(" ")


SCRIPTS = ["local.sh", "multinode.sh", "slurm.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_scripts_restart_and_resume_by_default(script: str, tmp_path: Path) -> None:
    # without the configuration check before launch (launch/precheck.sh, one Python process): not what this test
    # reads; tests/e2e/test_bad_inputs.py runs it under each script
    argv = launch(script, ["model=gpt-1b", "train.steps=5"], tmp_path, HYBRID_CHECK="0")
    assert argv[0] == "share=1"  # a fresh TCPStore per attempt: restarts work (see launch/local.sh)
    assert {"--max-restarts=3", "--max_restarts=3"} & set(argv), argv
    module = argv.index("-m")
    assert argv[module + 1:] == ["hybrid.train", "checkpoint.resume=auto", "model=gpt-1b", "train.steps=5"]
    if script == "local.sh":
        assert "--standalone" in argv and "--nproc_per_node=2" in argv


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_scripts_refuse_a_bad_max_restarts(script: str, tmp_path: Path) -> None:
    out = launch(script, ["model=gpt-1b"], tmp_path, MAX_RESTARTS="-1")
    assert out[:2] == ["exit", "2"] and len(out) == 3 and "must be a non-negative integer, got '-1'" in out[2], out


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("resume", ["checkpoint.resume=none", "checkpoint.resume=/x/step_0000010",
                                    "++checkpoint.resume=auto"])
def test_launch_scripts_keep_the_users_resume(script: str, resume: str, tmp_path: Path) -> None:
    argv = launch(script, ["model=gpt-1b", resume], tmp_path, MAX_RESTARTS="0", HYBRID_MODULE="killer",
                  TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0")
    assert argv[0] == "share=0"  # the user's choice stands
    assert {"--max-restarts=0", "--max_restarts=0"} & set(argv), argv
    assert argv[argv.index("-m") + 1:] == ["killer", "model=gpt-1b", resume]
