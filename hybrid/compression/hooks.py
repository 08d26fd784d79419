"""DP comm hooks: PyTorch DDP's protocol `hook(state, bucket) -> Future[Tensor]`, and a registry.

A hook receives a bucket (`buffer()`, `index()`, `is_last()`, `parameters()`, `gradients()`,
`set_buffer()`) holding the summed local gradients, and returns a future whose value is the
DP *mean* of that buffer. The same function runs in hybrid's `GradSync` and in
`torch.nn.parallel.DistributedDataParallel.register_comm_hook`. Bytes are counted at the
collective calls (`hybrid.parallel.collectives`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybrid.config import ConfigError
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

Hook = Callable[[Any, Any], torch.futures.Future]


def allreduce_hook(group: Group, bucket: Any) -> torch.futures.Future:
    """Exact mean: divide by the DP size, then one all-reduce (sum) of the whole bucket."""
    buf = bucket.buffer()
    buf.div_(C.size(group))
    work = C.all_reduce(buf, group, async_op=True)
    if work is None:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    return work.get_future().then(lambda f: f.value()[0])


def _allreduce(cfg: Any, group: Group) -> tuple[Hook, Any]:
    return allreduce_hook, group


REGISTRY: dict[str, Callable[[Any, Group], tuple[Hook, Any]]] = {"none": _allreduce}
"""method name → factory(compression cfg, DP group) → (hook, state)."""


def make_hook(cfg: Any, group: Group) -> tuple[Hook, Any]:
    """The (hook, state) pair for `compression.method`; one ConfigError line if unknown."""
    if cfg.method not in REGISTRY:
        raise ConfigError(f"compression.method={cfg.method!r} is not one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[cfg.method](cfg, group)
