"""What a replica-level sync mode keeps of each replica: the inner optimizer's view of the weights (`Weights`),
and the replica's own state for checkpoints — its parameters and inner optimizer state, which differ between
replicas between syncs (the checkpoint's DCP part, deduplicated over DP, holds only one replica's)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn


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
