"""PyTorch's own DDP comm hooks (`torch_fp16`, `torch_bf16`, `torch_powersgd`) in hybrid.

They run unchanged: `GradSync` hands them buckets with DDP's GradBucket interface. Their
collectives are `torch.distributed` calls inside PyTorch's modules, so those modules' `dist`
is replaced by `_CountingDist`, a proxy that records each all-reduce in hybrid's counter
(same group names, same bytes rule) and forwards everything else untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig


class _CountingDist:
    """`torch.distributed` with a counted `all_reduce` (the only collective these hooks use)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Any:
        n = dist.get_world_size(group)
        if n > 1:
            C.count(group, "all_reduce", tensor)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _install_counting() -> None:
    for module in (default_hooks, powerSGD_hook):
        if not isinstance(module.dist, _CountingDist):
            module.dist = _CountingDist()


def make_torch_hook(cfg: CompressionConfig, group: Group) -> tuple[Any, Any]:
    """(hook, state) of PyTorch's hook for `compression.method` = torch_fp16 | torch_bf16 | torch_powersgd."""
    _install_counting()
    if cfg.method == "torch_fp16":
        return default_hooks.fp16_compress_hook, group
    if cfg.method == "torch_bf16":
        return default_hooks.bf16_compress_hook, group
    state = powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=cfg.rank, start_powerSGD_iter=cfg.warmup_steps,
        min_compression_rate=cfg.min_compression_rate, use_error_feedback=cfg.error_feedback,
        warm_start=True, random_seed=cfg.seed)
    return powerSGD_hook.powerSGD_hook, state
