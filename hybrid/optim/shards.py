"""The distributed optimizer's shards: per DP bucket the flat parameter buffer, this rank's shard of it and the
*fragments* — the part of each parameter in that shard, an AdamW parameter whose `.grad` is the same range of the
reduced gradient shard.

Under ZeRO-1 and 2 the parameter buffer stays whole and the shard is a range of it. Under ZeRO-3 (`keep=True`)
the shard is a tensor of its own (`kept`), which the optimizer updates and `parallel.dp.units.FlatParams`
all-gathers into the buffer when a unit is used; the buffer's storage is freed in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from hybrid.parallel.dp.buckets import shard_span

if TYPE_CHECKING:
    from hybrid.parallel.dp.buckets import GradBucket

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Fragment:
    """The part of `param` that lies in this rank's shard: elements `[lo, lo + n)` of the flattened
    parameter, at `at` in the bucket; `view` is that range of the parameter buffer as an AdamW parameter,
    its `.grad` the same range of the gradient buffer."""

    param: nn.Parameter
    lo: int
    at: int
    n: int
    view: nn.Parameter


@dataclass
class ShardedBucket:
    """One gradient bucket's parameter buffer (the parameters' dtype), this rank's shard `[start, start + k)`
    of it, the fragments in it, the shard's fp32 main weights (`main`: a view of the parameter buffer when
    that is fp32, its own k elements under bf16 parameters) and Adam moments (flat, `k` elements each)."""

    bucket: GradBucket
    params: torch.Tensor
    start: int
    k: int
    main: torch.Tensor
    fragments: list[Fragment] = field(default_factory=list)
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    kept: Optional[torch.Tensor] = None  # ZeRO-3: this rank's parameter shard, kept apart from the freed buffer

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start: self.start + self.k]

    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameters (the parameters' dtype): kept apart (ZeRO-3), or the buffer's range."""
        return self.kept if self.kept is not None else self.shard(self.params)

    def separate_main(self) -> bool:
        """Whether the main weights are a copy (bf16 parameters) rather than the parameter shard itself."""
        return self.main.data_ptr() != self.param_shard().data_ptr()

    def spans(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """Every parameter of the bucket with its offset in the bucket and the flat range `[lo, hi)` of it
        that lies in this rank's shard (empty when lo == hi)."""
        return [(p, at, *shard_span(at, p.numel(), self.start, self.k))
                for p, at in zip(self.bucket.parameters(), self.bucket.offsets())]


def shard_bucket(bucket: GradBucket, grads: torch.Tensor, dp: int, dp_rank: int,
                 main: Optional[dict[nn.Parameter, torch.Tensor]] = None, keep: bool = False) -> ShardedBucket:
    """Move `bucket`'s parameters into one flat buffer of their dtype (each `p.data` a view of it) and cut out
    this rank's fragments, whose gradients are ranges of `grads` (this rank's reduced gradient shard); `main`
    holds the fp32 values of bf16 parameters (their shard becomes the bucket's main weights); `keep`: the
    parameter shard is copied out to a tensor of its own (ZeRO-3). Padding stays zero: its gradient is zero,
    so AdamW leaves it there."""
    first = bucket.parameters()[0]
    params = torch.zeros(bucket.numel(), dtype=first.dtype, device=first.device)
    k = bucket.numel() // dp
    sb = ShardedBucket(bucket, params, dp_rank * k, k, params)
    for p, offset, _, _ in sb.spans():
        params[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = params[offset: offset + p.numel()].view_as(p)
    sb.kept = sb.shard(params).clone() if keep else None
    sb.main = sb.param_shard() if main is None else torch.zeros_like(grads)
    sb.moments = {m: torch.zeros(k, dtype=torch.float32, device=first.device) for m in MOMENTS}
    for p, offset, lo, hi in sb.spans():
        if lo < hi:
            at = offset + lo - sb.start
            if main is not None:
                sb.main[at: at + hi - lo].copy_(main[p].reshape(-1)[lo:hi])
            view = nn.Parameter(sb.main[at: at + hi - lo])
            view.grad = grads[at: at + hi - lo]
            sb.fragments.append(Fragment(p, lo, offset + lo, hi - lo, view))
    return sb


