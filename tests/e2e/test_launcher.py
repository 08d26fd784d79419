"""The launch scripts' supervision, with the real torchrun:

- `launch/local.sh 2 ...` (which execs torchrun) SIGKILLed mid-run: both training ranks exit within
  seconds (hybrid.lifeline) instead of training on unsupervised.
- `launch/multinode.sh --nnodes 2` with only one node started: it says at once what it waits for, and
  after `--join-timeout` ends with one line and a non-zero status, no traceback.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_torchrun import QUICK, ROOT
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

STARTUP_S = 120  # torchrun's start-up and the ranks' on a loaded CI machine
GONE_S = 10  # the kernel's death signal is immediate; this is a generous bound


def children(pid: int) -> list[int]:
    """The pids of `pid`'s children, from /proc (every thread's list)."""
    tasks = Path(f"/proc/{pid}/task")
    return sorted({int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()})


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (a dead orphan may wait to be reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def importing_torch(pid: int) -> bool:
    """torch's library is mapped into `pid`: `python -m hybrid.train` imports the package `hybrid` (which
    holds the lifeline) before hybrid.train's own imports start, so this one is past that point."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_sigkilled_launcher(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "out.txt"
    cmd = ["bash", str(ROOT / "launch" / "local.sh"), "2", *QUICK, "train.steps=100000",
           f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    with out.open("w") as sink:
        # HYBRID_CHECK=0: no check before launch (one more fresh Python; tests/e2e/test_bad_inputs.py runs it)
        launcher = subprocess.Popen(cmd, cwd=ROOT, env={**env, "PYTHON": sys.executable, "MAX_RESTARTS": "0",
                                                        "HYBRID_CHECK": "0"},
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        def started() -> bool:
            ranks[:] = children(launcher.pid) if launcher.poll() is None else [0]
            return len(ranks) == 2 and all(importing_torch(r) for r in ranks)

        wait_for(lambda: started() or launcher.poll() is not None, STARTUP_S, "both ranks to start")
        assert launcher.poll() is None, out.read_text()[-3000:]
        launcher.kill()  # SIGKILL of the launcher (torchrun, exec'd by local.sh): it cannot stop its ranks
        launcher.wait()
        wait_for(lambda: not any(alive(r) for r in ranks), GONE_S, f"ranks {ranks} to exit after their launcher")
    finally:
        for pid in [launcher.pid, *ranks]:
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multinode_waiting_for_a_missing_node_says_so_and_times_out(env: dict[str, str]) -> None:
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"lonely{os.getpid()}"
    cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), "--nnodes", "2", "--node-rank", "0", "--nproc", "1",
           "--endpoint", endpoint, "--run-id", run_id, "--join-timeout", "3", "--max-restarts", "0", "train.steps=1"]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**env, "HYBRID_MODULE": "no_such_module"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        said = select.select([p.stderr], [], [], 20)[0]  # bash prints it before torchrun starts
        first = p.stderr.readline() if said else ""  # type: ignore[union-attr]
        assert first.strip() == (f"multinode.sh: node rank 0 waiting up to 3 s for 2 node(s) to join at {endpoint} "
                                 f"(rendezvous id {run_id})"), first
        assert p.poll() is None  # said before the join timeout could fire
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode != 0
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"multinode.sh: error: timed out after 3 s: fewer than 2 node(s) joined at {endpoint} "
                     f"(rendezvous id {run_id}); start the same command on every node, or raise --join-timeout"], err
