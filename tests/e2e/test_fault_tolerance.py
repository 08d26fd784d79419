"""Fault tolerance with the real torchrun: a rank SIGKILLed mid-run, or mid-save, and the run still
ends with the loss curve of an uninterrupted run, each step logged once.

- The reference: 2 ranks (dp2), 8 steps, a checkpoint every 3 steps (3, 6, 8), keep 2.
- Kill mid-run: `launch/local.sh` with its defaults (`--max-restarts=3`, `checkpoint.resume=auto`, a
  fresh TCPStore per attempt) runs `killer.py`, which SIGKILLs rank 1 at the start of step 6 on the
  first attempt; torchrun restarts both ranks, which resume step 3 by themselves and finish.
- Kill mid-save: rank 1 is SIGKILLed while writing its shard of step 6 (`--max-restarts=0`): the folder
  has no `.metadata`, `problem()` says so, and a new `checkpoint.resume=auto` run skips it with a
  warning, resumes step 3 and finishes.
- The launch scripts' defaults, checked without starting anything (`TORCHRUN=echo`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_torchrun import QUICK, ROOT, read_metrics
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.checkpoint import METADATA, list_steps, problem, step_path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# dropout on: a resume is bit-exact only if every rank's RNG streams come back too
TINY = [*QUICK, "model.hidden=64", "model.n_layers=2", "model.dropout=0.1", "train.steps=8", "checkpoint.every=3",
        "checkpoint.keep=2"]
RUN = "gpt-tiny-dp"  # run_name of the default model and parallel groups
TIMEOUT = 240


def run(cmd: list[str], env: dict[str, str], timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; on timeout kill its whole process group (torchrun and its ranks)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def dirs(tmp: Path) -> list[str]:
    return [f"checkpoint.dir={tmp / 'ck'}", f"logging.dir={tmp / 'run'}"]


def killer_env(env: dict[str, str], kill: str) -> dict[str, str]:
    return {**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'e2e'}", "HYBRID_KILL": kill, "HYBRID_KILL_RANK": "1"}


def folders(tmp: Path) -> dict[str, str | None]:
    """step folder name → problem() (None: complete and loadable)."""
    return {p.name: problem(p) for _, p in list_steps(tmp / "ck" / RUN)}


def latest(tmp: Path) -> str:
    return os.readlink(tmp / "ck" / RUN / "latest")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """The uninterrupted run: (step records, eval records)."""
    tmp = tmp_path_factory.mktemp("reference")
    r = run([*TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "hybrid.train", *TINY, *dirs(tmp)], env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert folders(tmp) == {"step_0000006": None, "step_0000008": None}  # keep=2
    assert latest(tmp) == "step_0000008"
    return read_metrics(tmp / "run")


def assert_same_run(tmp: Path, reference: tuple[list[dict], list[dict]]) -> None:
    """Each step (and eval) logged exactly once, and the loss curve bit-equal to the reference's."""
    steps, evals = read_metrics(tmp / "run")
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert [e["step"] for e in evals] == [4, 8]
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference[0]]
    assert [s["grad_norm"] for s in steps] == [s["grad_norm"] for s in reference[0]]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in reference[1]]


def test_rank_killed_mid_run_restarts_and_resumes(tmp_path: Path, env: dict[str, str],
                                                  reference: tuple[list[dict], list[dict]]) -> None:
    e = killer_env(env, "step:6") | {"TORCHRUN": " ".join(TORCHRUN), "HYBRID_MODULE": "killer"}
    e.pop("MAX_RESTARTS", None)
    r = run(["bash", str(ROOT / "launch" / "local.sh"), "2", *TINY, *dirs(tmp_path)], e)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-4000:]
    assert out.count("killer: SIGKILL rank 1 at the start of step 6") == 1
    attempts = sorted(re.findall(r"killer: attempt (\d+) rank (\d+)", r.stderr))
    assert attempts == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]  # exactly one restart of both ranks
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, 3)} at step 3" in out
    assert_same_run(tmp_path, reference)
    # keep=2 keeps steps 6 and 8, and also step 3: the checkpoint this session resumed from
    assert folders(tmp_path) == {"step_0000003": None, "step_0000006": None, "step_0000008": None}
    assert latest(tmp_path) == "step_0000008"


def test_rank_stopped_mid_run_is_timed_out_restarted_and_resumes(tmp_path: Path, env: dict[str, str],
                                                                reference: tuple[list[dict], list[dict]]) -> None:
    """A hung rank (SIGSTOP at step 6): rank 0's collective times out after parallel.timeout_s, it exits with the
    one line naming the group and writes its flight recorder; torchrun kills the stopped rank, restarts both,
    they resume step 3 and end with the uninterrupted loss curve."""
    e = killer_env(env, "stop:6") | {"TORCHRUN": " ".join(TORCHRUN), "HYBRID_MODULE": "killer"}
    e.pop("MAX_RESTARTS", None)
    r = run(["bash", str(ROOT / "launch" / "local.sh"), "2", *TINY, *dirs(tmp_path), "parallel.timeout_s=5"], e)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-4000:]
    assert out.count("killer: SIGSTOP rank 1 at the start of step 6") == 1
    line = next(x for x in out.splitlines() if "hybrid: error: collective" in x)
    assert re.search(r"on the (dp|world) group \(ranks \[0, 1\]\) failed (in|after) step \d+: ", line), line
    assert "parallel.timeout_s=5 s" in line and f"last collectives: {tmp_path / 'run' / 'flight' / 'rank0.txt'}" in line
    recorder = (tmp_path / "run" / "flight" / "rank0.txt").read_text()
    assert "flight recorder of rank 0" in recorder and re.search(r" (dp|world) .* (running|failed)\n", recorder)
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, 3)} at step 3" in out
    assert_same_run(tmp_path, reference)


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, env: dict[str, str],
                                                             reference: tuple[list[dict], list[dict]]) -> None:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    r = run([*cmd, "-m", "killer", *TINY, *dirs(tmp_path), "checkpoint.resume=auto"], killer_env(env, "save:6"))
    assert r.returncode != 0
    assert f"killer: SIGKILL rank 1 mid-write of {step_path(tmp_path / 'ck' / RUN, 6)}" in r.stderr, r.stderr[-3000:]
    partial = step_path(tmp_path / "ck" / RUN, 6)
    assert not (partial / METADATA).exists()
    assert folders(tmp_path) == {"step_0000003": None,
                                 "step_0000006": f"is incomplete: {METADATA} is missing (the save did not finish)"}
    assert latest(tmp_path) == "step_0000003"
    assert [s["step"] for s in read_metrics(tmp_path / "run")[0]] == list(range(1, 7))

    r = run([*cmd, "-m", "hybrid.train", *TINY, *dirs(tmp_path), "checkpoint.resume=auto"], env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-4000:]
    warning = f"hybrid: warning: checkpoint {partial} is incomplete: {METADATA} is missing (the save did not finish)"
    assert r.stderr.count("warning: checkpoint") == 1 and r.stderr.count(f"{warning}; skipping it") == 1, r.stderr
    assert f"checkpoint: resumed {step_path(tmp_path / 'ck' / RUN, 3)} at step 3" in out
    assert_same_run(tmp_path, reference)
    assert folders(tmp_path) == {"step_0000003": None, "step_0000006": None, "step_0000008": None}
    assert latest(tmp_path) == "step_0000008"


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
    argv = launch(script, ["model=gpt-1b", "train.steps=5"], tmp_path)
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
