"""The two collective timeouts (`parallel.timeouts.Timeouts`) read back from torch's gloo groups in one process:
the start-up one until the first step, the training one after it on every group but the async saves', the
start-up one again inside `relaxed()`; never a training timeout longer than the start-up one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid.parallel.collectives import name_group
from hybrid.parallel.timeouts import Timeouts


def seconds(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


@pytest.fixture()
def groups(tmp_path: Path) -> Iterator[dict[str, dist.ProcessGroup]]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=600))
    try:
        named = {"world": dist.distributed_c10d._get_default_group()}
        for name in ("dp", "checkpoint"):
            named[name] = dist.new_group([0], timeout=timedelta(seconds=600))
            name_group(named[name], name)
        yield named
    finally:
        dist.destroy_process_group()


def test_the_training_timeout_follows_the_first_step_but_not_a_save_or_an_eval(
        groups: dict[str, dist.ProcessGroup]) -> None:
    t = Timeouts(600, 100)
    assert {n: seconds(g) for n, g in groups.items()} == {"world": 600, "dp": 600, "checkpoint": 600}
    t.training()
    assert {n: seconds(g) for n, g in groups.items()} == {"world": 100, "dp": 100, "checkpoint": 600}
    assert (t.now_s, t.key) == (100, "parallel.train_timeout_s")
    with t.relaxed():
        assert (seconds(groups["dp"]), t.key) == (600, "parallel.timeout_s")
    with t.relaxed(when=False):
        assert seconds(groups["dp"]) == 100
    assert (seconds(groups["world"]), seconds(groups["dp"]), t.key) == (100, 100, "parallel.train_timeout_s")


@pytest.mark.parametrize(("start", "train", "after"), [(600, 0, 600), (5, 100, 5)])
def test_no_training_timeout_or_a_longer_one_keeps_the_start_up_one(
        groups: dict[str, dist.ProcessGroup], start: float, train: float, after: float) -> None:
    for g in groups.values():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=start), g)
    t = Timeouts(start, train)
    t.training()
    assert seconds(groups["dp"]) == after and t.key == "parallel.timeout_s"
