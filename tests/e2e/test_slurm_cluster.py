"""launch/slurm.sbatch under a real Slurm: slurmctld, slurmd and munge from Debian's packages, started on this
machine by scripts/slurm_cluster.sh. `make test-slurm` installs and starts the cluster, runs this file with
HYBRID_SLURM=1 and stops it; without HYBRID_SLURM the file is skipped (the stub chain of tests/e2e/test_slurm_signal.py
runs everywhere), and with it a cluster that is not up fails.

- A job trains: `sbatch` of the TINY run (dp2: one node × 2 ranks, and 2 nodes × 1 rank where the cluster has two
  slurmd's) exits 0, and its losses, gradient norms and eval losses equal the forked reference run's bit for bit.
- Preemption: while every rank holds at the start of step HOLD (killer.py's `hold`), `scancel --signal=USR1
  --batch` sends the batch shell what `--signal=B:USR1@120` sends before the time limit; the shell has Slurm
  TERM the job's step, every rank saves and exits 0, and with REQUEUE=1 the shell requeues the job; the requeued
  job (SLURM_RESTART_COUNT=1: killer.py holds no more) resumes from that checkpoint and finishes with the
  reference's numbers, each step logged once.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_fault_tolerance import RUN, dirs
from test_signal_save import ARGS, HOLD, SAVED, STEPS
from test_torchrun import ROOT, TINY, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.checkpoint import step_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("HYBRID_SLURM") != "1",
                                                   reason="a real Slurm cluster: make test-slurm")]
JOB_TIMEOUT_S = 300


def slurm(*cmd: str) -> str:
    """A Slurm client command's output; its failure fails the test with what it printed."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stdout}{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def nodes() -> list[str]:
    """The cluster's idle nodes (fails when the cluster make test-slurm starts is not up)."""
    assert shutil.which("sbatch"), "Slurm's commands are not installed: scripts/slurm_cluster.sh install"
    names = slurm("sinfo", "-h", "-N", "-t", "idle", "-o", "%N").split()
    assert names, "no idle Slurm node: scripts/slurm_cluster.sh start"
    return sorted(set(names))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(tmp: Path, env: dict[str, str], n_nodes: int, args: list[str], *sbatch: str, **extra: str) -> str:
    """`sbatch launch/slurm.sbatch ARGS` from the repository root, `n_nodes` × (2 / n_nodes) ranks on the CPU; the
    job's id. The script's #SBATCH defaults ask for GPUs and 32 CPUs: the command line overrides them."""
    job_env = {**env, "NPROC_PER_NODE": str(2 // n_nodes), "RDZV_PORT": str(free_port()), "MAX_RESTARTS": "0",
               **extra}
    cmd = ["sbatch", "--parsable", f"--nodes={n_nodes}", "--cpus-per-task=1", "--gpus-per-node=0",
           f"--output={tmp / 'job-%j.out'}", "--open-mode=append", *sbatch, str(ROOT / "launch" / "slurm.sbatch"),
           *args, *dirs(tmp)]
    r = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as KEY → value."""
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "-o", job_id)))


def wait_done(job_id: str, tmp: Path, restarts: int = 0) -> dict[str, str]:
    """Until the job has ended (after `restarts` requeues). Slurm makes a requeued job eligible 2 minutes later
    (Reason=BeginTime): the test moves its start to now."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        info = job(job_id)
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
            slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") \
                and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=60)
    pytest.fail(f"job {job_id} did not end within {JOB_TIMEOUT_S} s: {job(job_id)}\n{log(tmp, job_id)[-3000:]}")


def log(tmp: Path, job_id: str) -> str:
    path = tmp / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""


def wait_for(tmp: Path, job_id: str, text: str, count: int) -> None:
    """Until the job's log holds `text` `count` times (fails when the job ends first)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while log(tmp, job_id).count(text) < count:
        state = job(job_id)["JobState"]
        if state not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            pytest.fail(f"job {job_id} is {state} before {count}× {text!r}:\n{log(tmp, job_id)[-3000:]}")
        time.sleep(0.2)


def assert_reference(tmp: Path, reference: Any) -> None:
    steps, evals = read_metrics(tmp / "run")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference.steps]
    assert [s["grad_norm"] for s in steps] == [s["grad_norm"] for s in reference.steps]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in reference.evals]


@pytest.mark.parametrize("n_nodes", [1, 2])
def test_a_job_trains_to_the_reference(tmp_path: Path, env: dict[str, str], nodes: list[str], n_nodes: int,
                                       tiny_reference: Any) -> None:
    if n_nodes > len(nodes):
        pytest.skip(f"the cluster has {len(nodes)} node(s): Debian's slurmd runs one per host")
    job_id = submit(tmp_path, env, n_nodes, TINY)
    info = wait_done(job_id, tmp_path)
    out = log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-3000:]
    head = slurm("scontrol", "show", "hostnames", info["NodeList"]).split()[0]
    assert f"job {job_id}: {n_nodes} nodes x {2 // n_nodes} ranks, rendezvous at {head}:" in out
    assert_reference(tmp_path, tiny_reference)


def test_usr1_saves_on_every_rank_and_the_requeued_job_resumes_bit_exact(tmp_path: Path, env: dict[str, str],
                                                                          nodes: list[str],
                                                                          tiny_reference: Any) -> None:
    killer = {"HYBRID_MODULE": "killer", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'e2e'}",
              "HYBRID_KILL": f"hold:{HOLD}", "HYBRID_KILL_RANK": "all", "REQUEUE": "1"}
    job_id = submit(tmp_path, env, 1, ARGS, "--requeue", **killer)
    wait_for(tmp_path, job_id, f"holds at the start of step {HOLD}", 2)
    slurm("scancel", "--signal=USR1", "--batch", job_id)
    info = wait_done(job_id, tmp_path, restarts=1)
    out = log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-4000:]
    assert "SIGUSR1 (time limit near): asking every rank to save and exit" in out
    assert f"job {job_id}: requeued (REQUEUE=1)" in out
    (step, sig), = SAVED.findall(out)
    assert sig == "SIGTERM" and HOLD - 1 <= int(step) <= HOLD, out[-4000:]
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, int(step))} at step {step}" in out
    assert_reference(tmp_path, tiny_reference)
