"""launch/slurm.sbatch's signal chain, with stub `srun`, `scancel`, `scontrol` and torchrun on PATH (no
Slurm here): USR1 to the batch shell (what `--signal=B:USR1@120` sends before the time limit) makes it
`scancel --signal=TERM` the job's steps; the stub agent gets that SIGTERM and exits; with REQUEUE=1
the shell then requeues the job and exits 0. Without a signal the shell returns srun's status, and
passes --cpus-per-task on to srun. HYBRID_CHECK=0: the configuration check before launch (a fresh Python
process each time) is not this chain; tests/e2e/test_bad_inputs.py runs it through slurm.sbatch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = {
    # srun: note its options, drop them, and become the task
    "srun": 'echo "srun $*" >> "$STUB_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    # Slurm delivering scancel's signal to the step's processes: here the one stub task
    "scancel": 'echo "scancel $*" >> "$STUB_LOG"\nkill -"${1#--signal=}" "$(cat "$STUB_DIR/task.pid")"\n',
    "scontrol": 'if [[ "$1" == show ]]; then echo node-a; else echo "scontrol $*" >> "$STUB_LOG"; fi\n',
    # the torchrun agent: on SIGTERM its ranks would save; it exits 1 as torchrun does after a signal
    "torchrun": ('echo "torchrun PET_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE" >> "$STUB_LOG"\n'
                 'trap \'echo "task got TERM" >> "$STUB_LOG"; exit 1\' TERM\n'
                 'echo $$ > "$STUB_DIR/task.pid"\n'
                 'for _ in $(seq 600); do sleep 0.05; [[ -n "$STUB_EXIT" ]] && exit "$STUB_EXIT"; done\nexit 9\n'),
}


def start(tmp: Path, **extra: str) -> tuple[subprocess.Popen, Path]:
    stubs = tmp / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text("#!/usr/bin/env bash\n" + body)
        (stubs / name).chmod(0o755)
    log = tmp / "log"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_DIR": str(tmp), "STUB_LOG": str(log),
           "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node-a", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_GPUS_ON_NODE": "2", "HYBRID_CHECK": "0", **extra}
    env.pop("PET_SIGNALS_TO_HANDLE", None)
    p = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), "model=gpt-tiny"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return p, log


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"slurm.sbatch did not exit: {p.communicate()[1]}")
    return p.returncode, err


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_usr1_to_the_batch_shell_reaches_the_agents_and_requeues(tmp_path: Path) -> None:
    p, log = start(tmp_path, REQUEUE="1", SLURM_CPUS_PER_TASK="16")
    deadline = time.monotonic() + 30
    while not (tmp_path / "task.pid").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGUSR1)
    rc, err = finish(p)
    assert rc == 0, err
    got = lines(log)
    assert got[0] == "srun --kill-on-bad-exit=1 --cpus-per-task=16 torchrun --nnodes=1 --nproc_per_node=2 " \
        "--rdzv_backend=c10d --rdzv_endpoint=node-a:29500 --rdzv_id=7 --max_restarts=3 -m hybrid.train " \
        "checkpoint.resume=auto model=gpt-tiny"
    assert got[1] == "torchrun PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert got[2:] == ["scancel --signal=TERM 7", "task got TERM", "scontrol requeue 7"]
    assert "srun exited with 1 after SIGUSR1" in err and "requeued (REQUEUE=1)" in err


@pytest.mark.parametrize("status", ["0", "3"])
def test_without_a_signal_the_job_returns_sruns_status(tmp_path: Path, status: str) -> None:
    p, log = start(tmp_path, STUB_EXIT=status, REQUEUE="1")
    rc, err = finish(p)
    assert rc == int(status), err
    assert [ln.split()[0] for ln in lines(log)] == ["srun", "torchrun"]  # no scancel, no requeue
    assert "--cpus-per-task" not in lines(log)[0]
