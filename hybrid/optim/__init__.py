"""Optimizers behind one seam: `ModelOptimizer.step(lr)` is the whole update after `finalize_grads`.

`adamw.py` holds AdamW with clip-by-global-norm (and the LR schedule); `mixed.py` the same over fp32 main
weights of bf16 parameters (`train.precision=bf16_params`); `distributed.py` the distributed optimizer
(ZeRO-1: the same AdamW over this DP rank's shard, with or without bf16 parameters); `onebit_adam.py` 1-bit
Adam's optimizer (its variance refreshed every k steps, or frozen), whose momentum `compression=onebit_adam`
exchanges; `zeroone_adam.py` 0/1 Adam's
(`compression=zeroone_adam`: the variance refreshed on a schedule, then local steps). `build_optimizer` picks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.compression.zeroone_adam import ZeroOneExchange
from hybrid.optim.adamw import ModelOptimizer, adamw, clip_grads, global_grad_norm, lr_at, param_groups
from hybrid.optim.distributed import DistributedOptimizer
from hybrid.optim.mixed import MainWeightsOptimizer, to_low_precision
from hybrid.optim.onebit_adam import OneBitAdam
from hybrid.optim.zeroone_adam import ZeroOneAdam
from hybrid.parallel.collectives import Group
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.data import GradSync

if TYPE_CHECKING:
    from hybrid.compression.hooks import Compression
    from hybrid.config import OptimConfig

__all__ = ["DistributedOptimizer", "MainWeightsOptimizer", "ModelOptimizer", "to_low_precision",
           "OneBitAdam", "ZeroOneAdam", "adamw", "build_optimizer", "clip_grads", "global_grad_norm", "lr_at",
           "param_groups"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float, ctx: ParallelContext, grad_sync: GradSync,
                    main: Optional[dict[nn.Parameter, torch.Tensor]] = None, overlap_param_gather: bool = False,
                    onebit: Optional[Compression] = None, param_codec: Any = None, hpz: Group = None,
                    steps: int = 0) -> ModelOptimizer | DistributedOptimizer:
    """The optimizer of `model`, whose gradients `grad_sync` owns: AdamW with clipping at `cfg.grad_clip`;
    the distributed optimizer (ZeRO-1, 2, 3: `param_codec` encodes ZeRO-3's parameter all-gather, `hpz` is its
    secondary group) when `grad_sync`
    reduce-scatters (`parallel.zero>=1`); AdamW over the fp32
    `main` weights of bf16 parameters (`to_low_precision`'s answer) when given (ZeRO-1 too; it leaves its
    parameter all-gather in flight for the next forward with `overlap_param_gather`); 1-bit Adam's when given
    `onebit`, the hook state of `compression=onebit_adam` whose momentum exchange it drives (fp32 parameters), or
    0/1 Adam's for `compression=zeroone_adam`'s, its schedule sized from the run's `steps` (`train.steps`)."""
    if grad_sync.sharded:
        return DistributedOptimizer(model, cfg, lr, ctx, grad_sync, main, overlap_param_gather, param_codec, hpz)
    if main is not None:
        return MainWeightsOptimizer(grad_sync.parameters(), main, cfg, lr, ctx)
    if onebit is not None and isinstance(onebit.state, ZeroOneExchange):
        return ZeroOneAdam(adamw(model, cfg, lr), grad_sync.buckets, ctx, cfg.grad_clip, onebit, steps)
    if onebit is not None:
        return OneBitAdam(adamw(model, cfg, lr), grad_sync.buckets, ctx, cfg.grad_clip, onebit)
    return ModelOptimizer(adamw(model, cfg, lr), grad_sync.parameters(), ctx, cfg.grad_clip)
