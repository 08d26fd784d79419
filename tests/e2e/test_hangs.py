"""A rank that stops answering: with `parallel.timeout_s` every group's collectives time out, and the run
ends with one line naming the group, its ranks, the operation and the step (hybrid.parallel.timeouts).

- `collective_fault` on forked gloo ranks where rank 1 never joins: a blocking all_reduce (the group is
  the call's argument) and an async one waited for through an object holding the group (a DP bucket).
- The real entry point under torchrun: rank 1 SIGSTOPped mid-training; rank 0 exits 1 within 10× the timeout
  (it takes the timeout and a little more; the bound only tells a detected hang from an undetected one), with
  the line and no Python traceback of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from test_launcher import children, wait_for
from test_torchrun import QUICK, ROOT
from test_torchrun import env as env  # noqa: F401  (the shared fixture)

from hybrid.parallel.collectives import name_group
from hybrid.parallel.timeouts import collective_fault
from hybrid.testing.ranks import launch

TIMEOUT_S = 1.0


class _Bucket:
    """Holds its group, as the DP gradient buckets do."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def reduce(self) -> None:
        dist.all_reduce(torch.ones(8), group=self.group, async_op=True).wait()


def _one_rank_missing(rank: int, world: int) -> list[Any]:
    from datetime import timedelta

    groups = [dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S)) for _ in range(2)]
    for group in groups:
        name_group(group, "dp")
    if rank == 1:
        time.sleep(2.5 * TIMEOUT_S)  # never joins: both of rank 0's collectives time out
        return []
    def train_step() -> None:  # a fault inside a training step is "in step <completed + 1>"
        dist.all_reduce(torch.ones(8), group=groups[0])

    lines = []
    for call in (train_step, _Bucket(groups[1]).reduce):
        try:
            call()
            lines.append(None)
        except RuntimeError as e:
            lines += [collective_fault(e, 6, TIMEOUT_S), collective_fault(e, None, TIMEOUT_S)]
    return lines


def test_a_timed_out_collective_names_its_group_and_operation() -> None:
    lines = launch(_one_rank_missing, 2, timeout=60)[0]
    assert lines[0].startswith("collective all_reduce on the dp group (ranks [0, 1]) failed in step 7: Timed out")
    assert lines[1].startswith("collective all_reduce on the dp group (ranks [0, 1]) failed during start-up: ")
    assert lines[2].startswith("collective wait on the dp group (ranks [0, 1]) failed after step 6: Timed out")
    assert all("parallel.timeout_s=1 s" in line and "\n" not in line for line in lines)
    assert collective_fault(RuntimeError("shape mismatch"), 6, TIMEOUT_S) is None  # anything else: not ours


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=`rank` (its environment, from /proc)."""
    for pid in children(launcher):
        if f"RANK={rank}" in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"):
            return pid
    raise LookupError(rank)


def test_a_stopped_rank_ends_the_run_naming_the_group(tmp_path: Path, env: dict[str, str]) -> None:
    timeout_s = 5
    bound_s = 10 * timeout_s  # detection takes timeout_s and a little more; a loaded machine is still far below
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hybrid.train",
           *QUICK, "parallel=dp", f"parallel.timeout_s={timeout_s}", "train.steps=100000", "train.eval_every=0",
           "model.hidden=64", "model.n_layers=2", f"logging.dir={tmp_path / 'run'}"]
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    stopped = 0
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120, "two training steps")
        stopped = rank_pid(p.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        wait_for(lambda: "hybrid: error:" in (tmp_path / "err").read_text(), bound_s, "rank 0's error line")
        took = time.monotonic() - start
    finally:
        if stopped:
            os.kill(stopped, signal.SIGKILL)
        p.kill()
        p.wait(30)
    text = (tmp_path / "err").read_text()
    errors = [line for line in text.splitlines() if "hybrid: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("[rank0] hybrid: error: collective "), text[-3000:]
    # at dp=2 the step's collectives are the gradients' (dp) and the metrics' (world): either may be waiting
    assert re.search(r" on the (dp|world) group \(ranks \[0, 1\]\) failed (in|after) step \d+: Timed out", errors[0])
    assert "Traceback" not in text.split("hybrid: error:")[0]  # the rank's own line, not a traceback wall
    assert took < bound_s
    flight = tmp_path / "run" / "flight"
    assert errors[0].endswith(f"this rank's last collectives: {flight / 'rank0.txt'}")
    assert sorted(p.name for p in flight.iterdir()) == ["rank0.txt"]  # the stopped rank wrote nothing
    print(f"\nstopped rank detected after {took:.1f} s (parallel.timeout_s={timeout_s})")
