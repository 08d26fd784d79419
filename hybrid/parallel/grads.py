"""The model-parallel gradient reductions that follow DP sync (called by `data.finalize_grads`).

Two kinds of parameters hold only part of their gradient on a rank after the backward, however
the DP buckets were synced: the tied embedding, whose two copies (token embedding on the first
pipeline stage, output head on the last) each saw half of its uses, and, under sequence
parallelism, the TP-replicated parameters (norms, row-parallel biases, positions) that each TP
rank applied to its own sequence chunk only. Each is summed here over its group, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.params import param_info


def sync_tied_grads(params: Sequence[nn.Parameter], group: Group) -> None:
    """Sum the gradient of the tied embedding between the first stage (token embedding) and the
    last (output head, its `pp_duplicate` copy) over the embedding group, as Megatron does: both
    copies then take the same optimizer step and stay identical. One all-reduce per step."""
    tied = [p for p in params if param_info(p).pp_tied and p.grad is not None]
    if C.size(group) > 1:
        for p in tied:
            C.all_reduce(p.grad, group)


@torch.no_grad()
def sync_sequence_parallel_grads(params: Sequence[nn.Parameter], group: Group) -> None:
    """Sum, over the TP group, the gradients of replicated parameters that each TP rank applied
    to its own sequence chunk only (norms, row-parallel biases, positions): one coalesced
    all-reduce per step, after which these gradients are identical on every TP rank. A missing
    gradient counts as zeros, so every rank reduces the same number of elements."""
    params = [p for p in params if param_info(p).sequence_parallel]
    if not params or C.size(group) == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    C.all_reduce(flat, group)
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(part.view_as(p.grad))
