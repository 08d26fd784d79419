"""What the replica-level sync modes share (DiLoCo, gossip, the parameter server): a replica's own per-step
gradient sync and optimizer, the options they refuse, the inner optimizer's view of the weights (`Weights`),
and the replica's own state for checkpoints — its parameters and inner optimizer state, which differ between
replicas between syncs (the checkpoint's DCP part, deduplicated over DP, holds only one replica's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hybrid.compression.hooks import OPTIMIZER_SIDE, make_hook
from hybrid.config import CompressionConfig, Config, ConfigError
from hybrid.optim import build_optimizer
from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.data import GradSync, SyncReport

if TYPE_CHECKING:
    from hybrid.parallel.context import ParallelContext

INCOMPATIBLE = {"compression.method": ("hierarchical", *OPTIMIZER_SIDE), "compression.schedule": ("auto",),
                "parallel.zero": (1, 2, 3)}
"""Options a replica-level mode refuses: hierarchical compression (use `sync.scope=inter`), 1-bit and 0/1 Adam
(optimizer-side gradient compression), the auto compression schedule (it watches every step's gradient
exchange), the distributed optimizer (its shards assume replicas that agree)."""


class Weights(Protocol):
    """What a sync mode needs of the inner optimizer (`hybrid.optim`'s): each parameter's fp32 weight,
    `loaded()` after writing them (bf16 parameters follow their main weights), and for checkpoints its
    per-parameter `state` and the names of the tensors in it (`moments`)."""

    state: Any
    moments: tuple[str, ...]

    def main_weight(self, p: nn.Parameter) -> torch.Tensor: ...

    def loaded(self) -> None: ...


def replica_state(weights: Weights, params: list[nn.Parameter]) -> dict[str, Any]:
    """This replica's parameters (fp32 copies) and inner optimizer state, in `params`' order."""
    state, keys = weights.state, (*weights.moments, "step")
    return {"weights": [weights.main_weight(p).detach().clone() for p in params],
            "optim": [{k: state[p][k] for k in keys if k in state[p]} for p in params]}


@torch.no_grad()
def load_replica_state(weights: Weights, params: list[nn.Parameter], sd: dict[str, Any]) -> None:
    """Write back what `replica_state` saved (the same layout: the same parameters in the same order); the
    caller calls `weights.loaded()`."""
    state = weights.state
    for p, w, o in zip(params, sd["weights"], sd["optim"]):
        weights.main_weight(p).copy_(w)
        for k, v in o.items():
            state[p][k].copy_(v)


def flat_weights(weights: Weights, params: list[nn.Parameter]) -> torch.Tensor:
    """The fp32 weights of `params`, concatenated (a new buffer)."""
    return torch.cat([weights.main_weight(p).detach().float().reshape(-1) for p in params])


@torch.no_grad()
def set_flat_weights(weights: Weights, params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Write the concatenated `flat` back into the weights of `params` (the caller calls `weights.loaded()`)."""
    offset = 0
    for p in params:
        w = weights.main_weight(p)
        w.copy_(flat[offset: offset + w.numel()].view_as(w))
        offset += w.numel()


def over_ranks(values: list[float], device: torch.device, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
               ) -> list[float]:
    """`values` reduced over every rank (metrics only: an uncounted all-reduce on the default group, on `device`
    — NCCL's is CUDA —; the sum divided by the world size, i.e. the mean, for SUM). Collective: every rank calls
    it on logged steps."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return (t / dist.get_world_size() if op == dist.ReduceOp.SUM else t).tolist()


def check_replica_mode(cfg: Config) -> None:
    """The options no replica-level mode runs with (`INCOMPATIBLE`). Raises ConfigError (one line)."""
    for key, bad in INCOMPATIBLE.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value in bad:
            raise ConfigError(f"sync.mode={cfg.sync.mode} cannot run with {key}={value}"
                              + (" (use sync.scope=inter)" if value == "hierarchical" else ""))


def inner_group(cfg: Config, ctx: ParallelContext) -> Group:
    """The group a replica-level mode averages gradients over every step: the node's DP ranks under
    `sync.scope=inter`, else none (a replica alone)."""
    return ctx.dp_intra_group if cfg.sync.scope == "inter" else None


def inner_sync(cfg: Config, ctx: ParallelContext, model: nn.Module, main: Optional[dict]) -> GradSync:
    """A replica's per-step gradient sync: exact over `inner_group` (no communication when that is none)."""
    group = inner_group(cfg, ctx)
    exact, exact_state = make_hook(CompressionConfig(method="none"), group)
    return GradSync(list(model.parameters()), group, exact, exact_state, cfg.parallel.bucket_mb,
                    SyncReport(exact=True), main_grads=main is not None)


def inner_optimizer(cfg: Config, ctx: ParallelContext, model: nn.Module, grad_sync: GradSync,
                    main: Optional[dict]) -> Any:
    """A replica's own optimizer (AdamW or SGD; over fp32 main weights under bf16 parameters)."""
    return build_optimizer(model, cfg.optim, cfg.train.lr, ctx, grad_sync, main)


def trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a replica-level sync keeps in agreement: those trained, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def node_of(ctx: ParallelContext) -> Callable[[int], int]:
    """A DP rank (in this rank's DP group) → its node."""
    def node(dp_rank: int) -> int:
        return ctx.layout.node(ctx.layout.rank(pp=ctx.pp_rank, dp=dp_rank, tp=ctx.tp_rank, cp=ctx.cp_rank))
    return node


def single_replica_note(cfg: Config, dp: int) -> list[str]:
    """The start-up note of a mode with nothing to exchange: one replica (dp=1)."""
    if dp > 1:
        return []
    return [f"note: sync.mode={cfg.sync.mode} has nothing to exchange at dp=1: the run trains one replica"]
