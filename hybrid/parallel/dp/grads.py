"""The model-parallel gradient reductions that follow DP sync (called by `data.finalize_grads`).

Two kinds of parameters hold only part of their gradient on a rank after the backward, however
the DP buckets were synced: the tied embedding, whose two copies (token embedding on the first
pipeline stage, output head on the last) each saw half of its uses, and, under sequence
parallelism, the TP-replicated parameters (norms, row-parallel biases, positions) that each TP
rank applied to its own sequence chunk only. Each is summed here over its group, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.params import param_info


def grad_of(p: nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient of `p` as the step reads it after the backward: its fp32 `main_grad` (the gradient buffer's
    view, under `train.precision=bf16_params`; under ZeRO-2 and 3 the part of it in this DP rank's reduced shard,
    1-D and possibly empty) when it has one, else `.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def sync_tied_grads(params: Sequence[nn.Parameter], group: Group) -> None:
    """Sum the gradient of the tied embedding between the first stage (token embedding) and the
    last (output head, its `pp_duplicate` copy) over the embedding group, as Megatron does: both
    copies then take the same optimizer step and stay identical. One all-reduce per step — or none
    where one rank holds both copies (a V placement puts the first and the last part on pipeline
    rank 0, and the last pipeline rank then holds neither): the sum is then local."""
    tied = [grad_of(p) for p in params if param_info(p).pp_tied and grad_of(p) is not None]
    if len(tied) == 2:
        tied[0].add_(tied[1])
        tied[1].copy_(tied[0])
    elif C.size(group) > 1:
        for g in tied:
            C.all_reduce(g, group)


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
        if grad_of(p) is None:
            p.grad = torch.zeros_like(p)
    grads = [grad_of(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
