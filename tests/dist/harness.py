"""The multi-rank test harness: `run_ranks(fn, world, *args, timeout=...)` runs `fn(rank, world, *args)`
on `world` forked gloo ranks and returns their results by rank.

It is `hybrid.testing.ranks.launch` (the benchmarks use the same launcher): forking a parent that
has already imported torch starts 8 ranks in ~0.25 s (spawn: ~7 s); each child joins a TCP
rendezvous on a free local port, sends its result back serialised with torch.save, and ends with
the clean gloo shutdown (gc.collect, barrier, destroy_process_group). A rank that raises fails the
test with its traceback; a hang fails it after `timeout` seconds with every child killed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybrid.testing.ranks import launch


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` gloo ranks; return the results by rank."""
    return launch(fn, world, *args, timeout=timeout, init_timeout_s=60.0, **kwargs)
