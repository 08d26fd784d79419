"""AdamW behind the optimizer seam: `ModelOptimizer.step(lr)` is the whole update after `finalize_grads`.

As Megatron's `optimizer.step()`: set this step's LR, take the global gradient norm, clip by it,
run AdamW (no-decay groups for vectors), return the norm. `build_optimizer` builds it over the
parameters of a `GradSync`, in bucket order; a sharded (ZeRO-1) optimizer over the same buckets
would be a second class with the same `step(lr)`, chosen by `build_optimizer` (as 1-bit Adam's
`OneBitAdam` is, in `onebit_adam.py`).

The global norm counts every parameter exactly once across the mesh: a TP-sharded
parameter contributes its shard on every TP rank, a TP-replicated one (norms, biases of
row-parallel layers) only on TP rank 0, and a pipeline duplicate (the last stage's copy of
a tied embedding, marked `pp_duplicate`) not at all. The partial sums of squares are
all-reduced over the TP group, then the PP group. DP ranks hold identical (synced)
gradients, so DP takes no part.

A NaN or an inf in any rank's gradient makes that sum, and so the norm, non-finite on every rank of the
TP and PP groups (and of DP, whose replicas hold the same synced gradient): every optimizer then returns
the norm without updating anything (`finite`), the same decision on every rank without another
collective; `hybrid.nonfinite` decides what the run does next.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.grads import grad_of
from hybrid.parallel.params import param_info

if TYPE_CHECKING:
    from hybrid.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay; vectors (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer (AdamW, or SGD) over the model's fp32 parameters (the main weights themselves,
    unless `train.precision=bf16_params`: then `mixed.MainWeightsOptimizer`)."""
    return optimizer_over(param_groups(model, cfg.weight_decay), cfg, lr)


def adamw_over(groups: list[dict[str, Any]], cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over `groups` with `cfg`'s hyperparameters and kernels (`optim.implementation`): fused (one
    kernel per tensor, no temporaries: 5–6× faster than foreach at gpt-125m on CPU) or foreach."""
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **{cfg.implementation: True})


def optimizer_over(groups: list[dict[str, Any]], cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """`optim.name`'s torch optimizer over `groups`: AdamW, or SGD (momentum, Nesterov; its weight decay is
    coupled, torch's) — linear in the gradients, so averaging replicas after a step averages their gradients."""
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               **{cfg.implementation: True})
    return adamw_over(groups, cfg, lr)


def moments_of(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state tensors shaped as the parameter: Adam's two moments, SGD's momentum (if any)."""
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if optimizer.defaults["momentum"] else ()
    return ("exp_avg", "exp_avg_sq")


def fresh_state(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The state before the first step: zero moments shaped as `p`, and AdamW's step 0 (on `p`'s device for the
    fused kernel, on the CPU for foreach). SGD's zero momentum buffer acts as its absent one (no dampening)."""
    out = {k: torch.zeros_like(p) for k in moments_of(optimizer)}
    if not isinstance(optimizer, torch.optim.SGD):
        out["step"] = torch.zeros((), device=p.device if optimizer.defaults.get("fused") else torch.device("cpu"))
    return out


def sum_of_squares(g: torch.Tensor, row: int = 1024) -> torch.Tensor:
    """Σ g² in fp32 without a full-size temporary: the norms of `row`-element rows, squared and summed, plus
    the tail's. As accurate as `g.pow(2).sum()` (each row's sum is short); a whole-tensor
    `torch.linalg.vector_norm` in fp32 on CPU is not (0.5 % off on a 38.6 M-element tensor)."""
    f = g.detach().reshape(-1).float()
    k = f.numel() - f.numel() % row
    head = torch.linalg.vector_norm(f[:k].view(-1, row), dim=1).square().sum() if k else f.new_zeros(())
    return head + f[k:].square().sum()


def lr_at(step: int, peak: float, total_steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup from 0 over `warmup` steps, then cosine down to peak·min_ratio at `total_steps`.

    `step` counts from 0 (the LR of the first optimizer step is peak/warmup).
    """
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def counted_here(p: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank counts `p` in the global norm: not the pipeline duplicate of a tied embedding, and a
    TP-replicated parameter on TP rank 0 only."""
    info = param_info(p)
    return not (info.pp_duplicate or (info.tp_duplicate and tp_rank != 0))


def total_squares(grads: Sequence[torch.Tensor], device: torch.device, foreach: Optional[bool] = None) -> torch.Tensor:
    """Σ g² over `grads`, in fp32 on `device`. On CUDA (or `foreach`) one multi-tensor norm for them all
    (`torch._foreach_norm`: a few kernel launches for the whole model instead of about six per tensor, as torch's
    `clip_grad_norm_` does on CUDA); elsewhere tensor by tensor (`sum_of_squares`: accurate on CPU)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads and (device.type == "cuda" if foreach is None else foreach):
        return sq + torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32)).square().sum()
    for g in grads:
        sq = sq + sum_of_squares(g)
    return sq


def global_grad_norm(params: Iterable[nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each parameter counted once across TP and PP."""
    grads = [g for p in params if (g := grad_of(p)) is not None and counted_here(p, ctx.tp_rank)]
    sq = total_squares(grads, grads[0].device if grads else torch.device("cpu"))
    for group in (ctx.tp_group, ctx.pp_group):
        C.all_reduce(sq, group)
    return sq.sqrt()


def finite(norm: torch.Tensor) -> bool:
    """Whether the global gradient norm is finite: the optimizer steps only then. No collective: the norm
    is already the same on every rank (all-reduced), so every rank answers alike (a host sync on CUDA)."""
    return bool(torch.isfinite(norm))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's `optimizer` can skip its own update on a flag in device memory: the fused kernels
    (AdamW, SGD) read `found_inf` on the device, as under GradScaler, and step their counts back."""
    return bool(optimizer.defaults.get("fused"))


def guarded_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> bool:
    """Step `optimizer` unless `norm` is not finite. Fused kernels decide on the device (`found_inf`: no host
    read, the host runs on into the next step); others read the verdict on the host. True when it stepped or
    may have (decided on the device)."""
    if skips_on_device(optimizer):
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]
    elif not finite(norm):
        return False
    optimizer.step()
    return True


@torch.no_grad()
def clip_grads(params: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm when the norm exceeds max_norm; by 1 when the norm is not finite
    (no host read: such a step updates nothing, and its gradients stay as they were for the guard to name)."""
    if max_norm <= 0:
        return
    scale = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
    grads = [g for g in map(grad_of, params) if g is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))


class ModelOptimizer:
    """AdamW plus clip-by-global-norm over one rank's parameters: `step(lr)` updates them.

    `params` are the synced parameters in the order the norm sums them (GradSync's bucket order).
    `param_groups`, `state`, `state_dict()` and `load_state_dict()` are AdamW's own (checkpoints
    read the Adam moments per parameter through `state[p]`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], ctx: ParallelContext,
                 grad_clip: float) -> None:
        self.optimizer, self.params, self.ctx, self.grad_clip = optimizer, params, ctx, grad_clip

    def step(self, lr: float) -> torch.Tensor:
        """Set `lr`, clip the final gradients by their global norm (all-reduced over TP, then PP),
        take the AdamW step; return the norm before clipping. A non-finite norm updates nothing."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = global_grad_norm(self.params, self.ctx)
        clip_grads(self.params, self.grad_clip, norm)
        guarded_step(self.optimizer, norm)
        return norm

    @property
    def defers_verdict(self) -> bool:
        """Whether a non-finite step is refused on the device, so the run's guard may read the verdict later."""
        return skips_on_device(self.optimizer)

    @property
    def moments(self) -> tuple[str, ...]:
        """The per-parameter state tensors a checkpoint holds (`moments_of` the torch optimizer)."""
        return moments_of(self.optimizer)

    def fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """`p`'s state before the first step (for a checkpoint load to fill in place)."""
        return fresh_state(p, self.optimizer)

    def main_weight(self, p: nn.Parameter) -> torch.Tensor:
        """What a checkpoint holds as `p`'s weight: `p` itself (fp32; `MainWeightsOptimizer` keeps copies)."""
        return p.detach()

    def loaded(self) -> None:
        """After a checkpoint load: nothing to do (the load wrote the parameters themselves)."""

    def reload_main(self) -> None:
        """After `model.init_from` wrote the parameters: nothing to do (they are the main weights)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
