"""A rank that stops answering: with `parallel.timeout_s` every group's collectives time out, and the run
ends with one line naming the group, its ranks, the operation and the step (hybrid.parallel.timeouts).

- `collective_fault` on forked gloo ranks where rank 1 never joins: a blocking all_reduce (the group is
  the call's argument) and an async one waited for through an object holding the group (a DP bucket).
- The real entry point, `hybrid.train.main` as 2 ranks forked from this process (hybrid.testing.cli_runs),
  a short `parallel.train_timeout_s` behind a long `parallel.timeout_s`:
  rank 1 SIGSTOPs itself at the start of step 3 (killer.py's `stop`); rank 0 exits 1 with the line, no Python
  traceback of its own, and its flight recorder (the stopped rank writes none), long before the runs' deadline
  (an undetected hang would meet it and read -9); then it SIGKILLs the stopped rank, as a launcher would. The same
  under the real torchrun, a hung rank restarted: tests/e2e/test_fault_tolerance.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import killer
import torch
import torch.distributed as dist
from test_torchrun import QUICK

from hybrid.parallel.collectives import name_group
from hybrid.parallel.timeouts import collective_fault
from hybrid.testing.cli_runs import run_forked_ranks
from hybrid.testing.ranks import launch

TIMEOUT_S = 1.0
RUN_TIMEOUT_S = 120  # the forked run's deadline: rank 0 detects the stop after parallel.train_timeout_s (5 s)


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


def stopping(pids: Path) -> Callable[[], None]:
    """killer.py's `main` (the fault HYBRID_KILL armed, the pid written into `pids`); rank 0, once its run has
    ended, SIGKILLs rank 1 (stopped: it would never end by itself)."""
    def main() -> None:
        try:
            killer.main(pids)
        finally:
            if os.environ["RANK"] == "0":
                os.kill(int((pids / "1").read_text()), signal.SIGKILL)
    return main


def test_a_stopped_rank_ends_the_run_naming_the_group(tmp_path: Path, forking: dict[str, str]) -> None:
    """The start-up timeout at Megatron's 10 minutes, the training one at 5 s — far above a step's collectives
    (milliseconds) on a loaded machine, so only the stop trips it: a rank stopped at step 3 ends the run after the
    training one (a 600 s wait would meet the run's deadline and read -9), and the line names it."""
    argv = [*QUICK, "parallel=dp", "parallel.timeout_s=600", "parallel.train_timeout_s=5", "train.steps=100000",
            "train.eval_every=0", "model.hidden=64", "model.n_layers=2", f"logging.dir={tmp_path / 'run'}"]
    (tmp_path / "pids").mkdir()
    env = {**forking, "HYBRID_KILL": "stop:3", "HYBRID_KILL_RANK": "1"}
    runs = run_forked_ranks(stopping(tmp_path / "pids"), argv, tmp_path, 2, env, timeout_s=RUN_TIMEOUT_S)
    assert [r.code for r in runs] == [1, -9], runs[0].stderr[-3000:]
    assert "killer: SIGSTOP rank 1 at the start of step 3" in runs[1].stderr
    text = runs[0].stderr
    errors = [line for line in text.splitlines() if "hybrid: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("[rank0] hybrid: error: collective "), text[-3000:]
    # at dp=2 the step's collectives are the gradients' (dp) and the metrics' (world): either may be waiting
    assert re.search(r" on the (dp|world) group \(ranks \[0, 1\]\) failed (in|after) step \d+: Timed out", errors[0])
    assert "stopped answering for parallel.train_timeout_s=5 s" in errors[0]
    assert "Traceback" not in text.split("hybrid: error:")[0]  # the rank's own line, not a traceback wall
    flight = tmp_path / "run" / "flight"
    assert errors[0].endswith(f"this rank's last collectives: {flight / 'rank0.txt'}")
    assert sorted(p.name for p in flight.iterdir()) == ["rank0.txt"]  # the stopped rank wrote nothing

