"""The rank launcher itself (`hybrid.testing.ranks.launch`): forked and spawned ranks give the same collective
results, and a rank that raises fails the launch with its traceback, under either start method (spawned: one
rank, ~3.5 CPU-s of imports each; that the others are stopped when one fails is shown with forked ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybrid.testing.ranks import launch


def _gathered(rank: int, world: int) -> list[float]:
    t = torch.tensor([float(rank + 1)])
    every = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(every, t)
    return [float(x) for x in every]


def _raises(rank: int, world: int) -> None:
    if rank == world - 1:
        raise ValueError("the last rank says no")


@pytest.mark.timeout(120)
def test_spawned_ranks_match_forked_ones() -> None:
    forked = launch(_gathered, 2, timeout=60, method="fork")
    assert forked == [[1.0, 2.0]] * 2  # every rank saw every rank's value, in rank order
    assert launch(_gathered, 2, timeout=100, method="spawn") == forked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,world", [("fork", 2), ("spawn", 1)])
def test_a_failing_rank_fails_the_launch_with_its_traceback(method: str, world: int) -> None:
    with pytest.raises(RuntimeError, match=f"rank {world - 1} failed") as e:
        launch(_raises, world, timeout=100, method=method)
    assert "the last rank says no" in str(e.value)
