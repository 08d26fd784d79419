"""The fused head: linear + cross-entropy over the (vocab-parallel, padded) vocabulary, `chunk` tokens at a time.

`fused_linear_cross_entropy(x, W, target, …)` is the mean token cross-entropy of `x Wᵀ`, the head's
`column_linear` and `vocab_parallel_cross_entropy` in one, without the whole [b·s, vocab/tp] fp32 logits or
their gradient ever existing. The flattened tokens are taken `chunk` at a time; per chunk:

- the chunk's fp32 logits on this rank's vocabulary shard (padded entries, ≥ vocab_size, are left out);
- under TP, one all-reduce MAX of the chunk's row maxima, then one all-reduce SUM of its Σexp and its target
  logit (found on exactly one rank) stacked: per chunk because a chunk's softmax needs the whole Σexp before its
  gradient. Together 3·b·s fp32 elements, the bytes of `_VocabParallelCE`'s three all-reduces (two calls a
  chunk instead of three for the whole batch);
- the chunk's loss and, when a gradient is wanted, its gradients right away: (softmax − onehot)/N times W
  gives the chunk's rows of x's gradient, its transpose times x's chunk is added to W's gradient (fp32).

So no chunk's logits survive it: the Function keeps x's and W's fp32 gradients and its backward only scales
them (in place) by the incoming scalar gradient. Under no_grad (evaluation) only the loss is computed.

Communication of x (the counted region ops of `hybrid.parallel.collectives`): without sequence parallelism x is
whole on every rank and enters through `copy_to_region` — identity forward, all-reduce of x's gradient backward
(each rank's is a partial sum over its vocabulary shard). With SP x is this rank's sequence chunk and enters
through `gather_from_sequence` — all-gathered along the sequence once, forward; x's gradient reduce-scattered
backward. The gathered input lives only through the forward: W's gradient is made there, so there is no backward
regather (`column_linear` keeps the chunk and gathers it again). Under autocast x and W are cast to its dtype
first (as `column_linear` does: the exchanges and matmuls run in bf16), the loss math is fp32, and the returned
gradients are in the inputs' dtypes.

A zero-bubble split backward (`hybrid.parallel.pp.split_backward`) finds the fused node to be the head weight's
frontier: its input pass asks it (`needed`) for x's gradient only, its weight pass for W's only, so W's
gradient is accumulated once per microbatch and x's reduction runs in the input pass alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.pp.split_backward import edges_of, needed
from hybrid.parallel.tp.tensor import autocast_inputs, check_sequence_chunk

MODES = ("auto", "on", "off")


def head_chunk(mode: str, chunk: int, device_type: str) -> int:
    """Tokens per chunk of the fused head, 0 for the unfused head: `train.fused_head` on, or auto on CUDA."""
    return chunk if mode == "on" or (mode == "auto" and device_type == "cuda") else 0


@dataclass(frozen=True)
class _Shard:
    """This rank's part of the vocabulary: rows [start, start + real) of the global head are real tokens."""

    group: Group
    start: int
    real: int

    def local(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's index into this shard, clamped where it is elsewhere; whether it is here)."""
        here = (target >= self.start) & (target < self.start + self.real)
        return (target - self.start).clamp(0, max(self.real - 1, 0)), here


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row's maximum over this shard (−inf on a shard of padding only)."""
    if logits.shape[1]:
        return logits.amax(dim=1)
    return logits.new_full(logits.shape[:1], float("-inf"))


def _softmax_and_loss(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, shard: _Shard
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(softmax of the chunk's logits on this shard, fp32; the chunk's summed loss; target index; here)."""
    logits = (x @ w.t()).float()
    row_max = _row_max(logits)
    C.all_reduce(row_max, shard.group, op=dist.ReduceOp.MAX)
    logits.sub_(row_max.unsqueeze(1))
    local, here = shard.local(target)
    picked = logits.gather(1, local.unsqueeze(1)).squeeze(1) if shard.real else torch.zeros_like(row_max)
    sums = torch.stack([logits.exp_().sum(dim=1), picked.masked_fill(~here, 0.0)])
    C.all_reduce(sums, shard.group)  # Σexp and the target logit in one reduction
    return logits.div_(sums[0].unsqueeze(1)), (sums[0].log() - sums[1]).sum(), local, here


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b: in place when the dtypes agree, else the product (in a's dtype) added in out's."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _one_chunk(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, shard: _Shard, n: int,
               grads: tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> torch.Tensor:
    """A chunk's summed loss; its gradients (of the mean over `n` tokens) set in x's rows grads[0] and added to
    W's grads[1], where given. Its logits, softmax in place, die here."""
    p, loss, local, here = _softmax_and_loss(x, w, target, shard)
    if grads == (None, None):
        return loss
    if w.shape[0]:
        p.scatter_add_(1, local.unsqueeze(1), -here.to(p.dtype).unsqueeze(1))
    g = p.mul_(1.0 / n).to(x.dtype)
    if grads[0] is not None:
        grads[0].copy_(g @ w)
    if grads[1] is not None:
        _add_product(grads[1][: w.shape[0]], g.t(), x)
    return loss


def _chunked(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, shard: _Shard, chunk: int,
             want: tuple[bool, bool]) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(mean loss, x's gradient, W's gradient — fp32, None where not `want`ed) of x [N, h], W [rows, h], `chunk`
    tokens at a time."""
    n, real = x.shape[0], w[: shard.real]
    grad_x = x.new_empty(x.shape, dtype=torch.float32) if want[0] else None
    grad_w = w.new_zeros(w.shape, dtype=torch.float32) if want[1] else None
    total = x.new_zeros((), dtype=torch.float32)
    for lo in range(0, n, chunk):
        rows = slice(lo, min(lo + chunk, n))
        total += _one_chunk(x[rows], real, target[rows], shard, n, (grad_x[rows] if want[0] else None, grad_w))
    return total / n, grad_x, grad_w


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """x [N, h], W [rows, h] → the mean loss; the gradients are made in the forward and kept (`save_for_backward`:
    outer saved-tensor hooks and the split backward's boxes hold them); backward scales what the pass `needed`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, shard: _Shard,  # noqa: ANN001
                chunk: int) -> torch.Tensor:
        loss, grad_x, grad_w = _chunked(x, weight, target, shard, chunk, tuple(ctx.needs_input_grad[:2]))
        ctx.save_for_backward(grad_x, grad_w)
        ctx.edges, ctx.dtypes = edges_of(x, weight), (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        kept = ctx.saved_tensors
        want = needed(ctx.needs_input_grad[:2], ctx.edges)  # a split backward's pass: x's, W's, or both
        # in place, as `_VocabParallelCE`: each kept gradient is read once (a pass reads its own); no second backward
        out = [k.mul_(g).to(dtype) if w and k is not None else None for k, w, dtype in zip(kept, want, ctx.dtypes)]
        return out[0], out[1], None, None, None


def _enter(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """x whole on this rank: copied in (x's gradient all-reduced backward) or, under SP, all-gathered along the
    sequence (x's gradient reduce-scattered backward)."""
    if not sequence_parallel or C.size(group) == 1:
        return C.copy_to_region(x, group)
    check_sequence_chunk(x)
    return C.gather_from_sequence(x, group)


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Group,
                               vocab_size: int, chunk: int, sequence_parallel: bool = False) -> torch.Tensor:
    """Mean token cross-entropy of `x Wᵀ` (W: this rank's rows of the padded vocabulary), `chunk` tokens at a
    time; padded entries (≥ vocab_size) never count. x: [b, s, h] (under SP this rank's [b, s/tp, h]), target
    [b, s]. Equal to `vocab_parallel_cross_entropy(column_linear(x, W, …), …)` within fp32 rounding."""
    x, weight = autocast_inputs(x, weight)  # as `column_linear`: exchange and multiply in the autocast dtype
    start = C.rank(group) * weight.shape[0]
    shard = _Shard(group, start, max(0, min(weight.shape[0], vocab_size - start)))
    if C.size(group) == 1:
        weight = weight[:vocab_size]  # the padding sliced off (its gradient: zeros)
    flat = _enter(x, group, sequence_parallel).flatten(0, -2)
    if not (torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)):
        return _chunked(flat, weight, target.flatten(), shard, chunk, (False, False))[0]
    with torch.autocast(x.device.type, enabled=False):
        return _FusedLinearCrossEntropy.apply(flat, weight, target.flatten(), shard, chunk)
