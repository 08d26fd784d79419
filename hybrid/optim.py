"""AdamW with no-decay groups, warmup + cosine LR, and the global gradient norm.

The global norm counts every parameter exactly once across the mesh: a TP-sharded
parameter contributes its shard on every TP rank, a TP-replicated one (norms, biases of
row-parallel layers) only on TP rank 0, and a pipeline duplicate (the last stage's copy of
a tied embedding, marked `pp_duplicate`) not at all. The partial sums of squares are
all-reduced over the TP group, then the PP group. DP ranks hold identical (synced)
gradients, so DP takes no part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay; vectors (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: Any, lr: float) -> torch.optim.Optimizer:
    """AdamW over fp32 parameters (the master weights; bf16 exists only inside autocast)."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, foreach=True)


def lr_at(step: int, peak: float, total_steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup from 0 over `warmup` steps, then cosine down to peak·min_ratio at `total_steps`.

    `step` counts from 0 (the LR of the first optimizer step is peak/warmup).
    """
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def global_grad_norm(params: Iterable[nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each parameter counted once across TP and PP."""
    sq = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is None or getattr(p, "pp_duplicate", False):
            continue
        if getattr(p, "tp_duplicate", True) and ctx.tp_rank != 0:
            continue
        g = p.grad.detach().float()
        sq = sq.to(g.device) + g.pow(2).sum()
    for group in (ctx.tp_group, ctx.pp_group):
        C.all_reduce(sq, group)
    return sq.sqrt()


@torch.no_grad()
def clip_grads(params: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm when the norm exceeds max_norm."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
