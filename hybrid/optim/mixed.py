"""Megatron-style mixed precision (`train.precision=bf16_params`): bf16 parameters, fp32 main weights.

The model's parameters (and so its activations, and the pipeline's hidden states) are bf16; the optimizer
keeps an fp32 *main* copy of every parameter, updates it and writes it back to the bf16 parameter after each
step (Megatron's `Float16OptimizerWithFloat16Params`). The gradients accumulate in fp32 all along: GradSync
keeps them in its fp32 buckets as each parameter's `main_grad` (`GradSync(main_grads=True)`), the DP sync
runs on those buckets, and the norm, the clipping and AdamW read them (`parallel.dp.grads.grad_of`).

Per parameter: 2 bytes of bf16 weight, 4 of fp32 main gradient, 4 of fp32 main weight and 8 of moments —
18, against 16 in fp32 (Megatron's figure); with ZeRO-1 the main weight and the moments are the rank's 1/dp.

Checkpoints hold the fp32 main weights under the model's keys (`main_weight`), so they are the same files as
an fp32 run's: they export, and resume under any precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid.optim.adamw import ModelOptimizer, fresh_state, optimizer_over
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.grads import grad_of

if TYPE_CHECKING:
    from hybrid.config import OptimConfig

PARAM_DTYPE = torch.bfloat16


def to_low_precision(model: nn.Module, dtype: torch.dtype = PARAM_DTYPE) -> dict[nn.Parameter, torch.Tensor]:
    """Make every parameter of `model` a `dtype` copy of itself; return the fp32 values it held (the main
    weights: the same storage, not a copy). Buffers (RoPE's tables) keep their dtype."""
    main = {}
    for p in model.parameters():
        main[p] = p.data
        p.data = p.data.to(dtype)
    return main


def copy_main_to_model(pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Round every fp32 main weight into its bf16 parameter (one foreach copy)."""
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])


class MainWeightsOptimizer(ModelOptimizer):
    """`optim.name`'s optimizer (AdamW, SGD) over the fp32 main weights of bf16 parameters, clip-by-global-norm
    on the fp32 main gradients.

    `params` are the synced (bf16) parameters in bucket order, each with its fp32 `main_grad`; `main` maps each
    to its fp32 values. `param_groups` and `state` are keyed by the model's parameters, as the checkpoint
    reads them; `main_weight(p)` is what a checkpoint saves and loads under `p`'s key."""

    def __init__(self, params: list[nn.Parameter], main: dict[nn.Parameter, torch.Tensor], cfg: OptimConfig,
                 lr: float, ctx: ParallelContext) -> None:
        self.mains: dict[nn.Parameter, nn.Parameter] = {}
        for p in params:
            self.mains[p] = nn.Parameter(main[p], requires_grad=True)
            self.mains[p].grad = grad_of(p)  # the fp32 bucket view, for the whole run
        groups = [[p for p in params if (p.ndim >= 2) == d] for d in (True, False)]
        optimizer = optimizer_over([{"params": [self.mains[p] for p in groups[0]], "weight_decay": cfg.weight_decay},
                                    {"params": [self.mains[p] for p in groups[1]], "weight_decay": 0.0}], cfg, lr)
        for m in self.mains.values():
            optimizer.state[m] = fresh_state(m, optimizer)
        super().__init__(optimizer, params, ctx, cfg.grad_clip)
        self._groups = [{"params": g} for g in groups]

    def step(self, lr: float) -> torch.Tensor:
        """`ModelOptimizer.step` on the fp32 main weights, then each rounded into its bf16 parameter."""
        norm = super().step(lr)
        self.loaded()
        return norm

    def main_weight(self, p: nn.Parameter) -> torch.Tensor:
        """What a checkpoint holds as `p`'s weight: its fp32 main weight (a frozen parameter: itself)."""
        main = self.mains.get(p)
        return (p if main is None else main).detach()

    def loaded(self) -> None:
        """After a checkpoint load filled the main weights: the bf16 parameters follow."""
        copy_main_to_model([(p, m.detach()) for p, m in self.mains.items()])

    def reload_main(self) -> None:
        """After the model's parameters were written (`model.init_from`): the main weights take their values."""
        with torch.no_grad():
            for p, m in self.mains.items():
                m.copy_(p)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups

    @property
    def state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        return {p: self.optimizer.state[m] for p, m in self.mains.items()}
