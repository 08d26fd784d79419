"""ZeRO-2's gradients (`parallel.zero=2`): each bucket reduce-scattered every microbatch into a kept fp32 shard.

Under ZeRO-1 a bucket's fp32 buffer lives for the whole run and is reduce-scattered once per step. Here it lives
only while one microbatch's gradients of the bucket arrive and its reduce-scatter runs. GradSync's
post-accumulate hook hands each parameter's fresh `.grad` to `ShardedGrads.add`, which adds it into the
bucket's *round* buffer (allocated by the round's first arrival; a bucket that is one unpadded fp32 parameter
takes the gradient itself as its round) and drops it. Once every parameter of the
bucket has arrived, the round is launched: the buffer, divided by dp, is **reduce-scattered over DP**
(asynchronously; in the reduce dtype, or as a codec's encoded all-to-all) and its shard is added into this
rank's `shards[i]`, `k` fp32 elements kept across the step's microbatches. One round is in flight at a time:
launching the next waits for the previous (FSDP2's order), so two buckets' buffers are the transient cost. A
bucket larger than `parallel.bucket_mb` (one large parameter: an embedding) is reduce-scattered in pieces of
about that size — the same columns of every rank's shard, copied out (and cast) — one in flight at a time, so
the copies a reduce-scatter makes (the cast, gloo's of its input) are of a piece, not of the bucket.

Rounds launch in the order they complete, the same on every DP rank (the same schedule runs the same
backwards); a round can mix microbatches when a parameter gets no gradient in one (its sum is still the
step's), and `finish` launches whatever rounds are partial, in bucket order. Each parameter's `main_grad` is
its *fragment*: the part of this rank's shard that falls in it, 1-D and possibly empty, which the norm, the
clipping, the tied-embedding and sequence-parallel sums (aligned shards: the tied copies have a bucket each,
TP-replicated buckets are laid out alike on every TP rank) and the non-finite check read.

Bytes per step: every padded bucket reduce-scattered once per microbatch, m × (reduce dtype) × Σ padded
(counted as the input, as every reduce-scatter), against ZeRO-1's once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.buckets import GradBucket, shard_span

EncodedReduceScatter = Callable[[torch.Tensor, Group, int], Any]
"""ZeRO's compressed reduce-scatter: (flat buffer pre-divided by dp, DP group, bucket index) → this rank's shard of
the sum written in place (`compression.zero.OneHop`, or `TwoHop` across nodes)."""


def shard_of(buf: torch.Tensor, group: Group) -> torch.Tensor:
    """This DP rank's contiguous 1/dp of `buf`."""
    k = buf.numel() // C.size(group)
    return buf[C.rank(group) * k: (C.rank(group) + 1) * k]


class ShardedGrads:
    """The kept gradient shards of `buckets` (padded), filled by reduce-scattering each microbatch's round."""

    def __init__(self, buckets: Sequence[GradBucket], group: Group, reduce_dtype: torch.dtype,
                 encoded: Optional[EncodedReduceScatter], piece: int, scale: int = 0) -> None:
        self.buckets, self.group, self.reduce_dtype, self.encoded = list(buckets), group, reduce_dtype, encoded
        self.piece = piece  # elements a reduce-scatter takes at most (a bucket of one large parameter: in pieces)
        self.scale = scale or C.size(group)  # the ranks a gradient is averaged over (HSDP: its replicas' too)
        device = buckets[0].parameters()[0].device if buckets else torch.device("cpu")
        self.shards = [torch.zeros(b.numel() // C.size(group), device=device) for b in buckets]
        self._slot = {id(p): (at, p.numel()) for b in self.buckets  # id(p) → (offset in its bucket, numel)
                      for p, at in zip(b.parameters(), b.offsets())}
        self._arrived = [0] * len(self.buckets)
        self._inflight: Optional[tuple[int, int, torch.Tensor, Any]] = None  # (bucket, at, its result, work)
        self.rounds: list[tuple[int, bool]] = []  # this step's launches: (bucket, from the backward's hook)

    def fragment(self, p: nn.Parameter, b: int) -> torch.Tensor:
        """The part of this rank's shard of bucket `b` that falls in `p` (1-D, possibly empty)."""
        offset, n = self._slot[id(p)]
        k = self.shards[b].numel()
        start = C.rank(self.group) * k
        lo, hi = shard_span(offset, n, start, k)
        return self.shards[b][offset + lo - start: offset + hi - start]

    @torch.no_grad()
    def add(self, b: int, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Fold `p`'s gradient of this microbatch into bucket `b`'s round; launch the round once it is whole."""
        bucket = self.buckets[b]
        if not bucket.held() and self._alone(bucket, grad):
            bucket.attach(grad.view(-1))  # the round is the gradient autograd made: no copy of the largest buckets
        else:
            if not bucket.held():
                bucket.attach(torch.zeros(bucket.numel(), device=grad.device))
            offset, n = self._slot[id(p)]
            bucket.buffer()[offset: offset + n].add_(grad.reshape(-1))
        self._arrived[b] += 1
        if self._arrived[b] == len(bucket.parameters()):
            self.launch(b, in_backward=True)

    @staticmethod
    def _alone(bucket: GradBucket, grad: torch.Tensor) -> bool:
        """Whether `grad` can be the round itself: the bucket's one parameter, no padding, fp32, contiguous."""
        return (len(bucket.parameters()) == 1 and grad.numel() == bucket.numel() and grad.dtype == torch.float32
                and grad.is_contiguous())

    @torch.no_grad()
    def launch(self, b: int, in_backward: bool) -> None:
        """Reduce-scatter bucket `b`'s round over DP (after the previous round is folded in); a round larger than
        `piece` elements in pieces of about that size, one in flight at a time."""
        self.wait()
        self._arrived[b] = 0
        self.rounds.append((b, in_backward))
        buf = self.buckets[b].release().div_(self.scale)  # before any cast: the sum stays in range
        if self.encoded is not None:  # blocking (gloo's all-to-all): this rank's shard of the sum, in place
            self.encoded(buf, self.group, b)
            self.shards[b].add_(shard_of(buf, self.group))
            return
        if buf.numel() <= self.piece:
            low = buf if self.reduce_dtype == buf.dtype else buf.to(self.reduce_dtype)
            self._start(b, 0, shard_of(low, self.group), low)
            return
        dp, k = C.size(self.group), self.shards[b].numel()
        width = max(1, self.piece // dp)
        for lo in range(0, k, width):  # shard columns [lo, hi) of every rank: one reduce-scatter
            self.wait()
            part = buf.view(dp, k)[:, lo: lo + width].to(self.reduce_dtype, copy=True).contiguous()
            self._start(b, lo, part[C.rank(self.group)], part)

    def _start(self, b: int, lo: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        work = C.reduce_scatter_flat(out, inp, self.group, async_op=True)
        self._inflight = (b, lo, out, work)

    def wait(self) -> None:
        """Fold the reduce-scatter in flight, if any, into its shard (the wait is the DP group's exposed time)."""
        if self._inflight is None:
            return
        b, lo, out, work = self._inflight
        self._inflight = None
        if work is not None:
            with C.TIMER.waiting(C.group_name(self.group), "reduce_scatter"):
                work.wait()
        self.shards[b][lo: lo + out.numel()].add_(out)

    def finish(self) -> None:
        """Launch the partial rounds (parameters without a gradient this microbatch), in bucket order; wait."""
        for b, bucket in enumerate(self.buckets):
            if bucket.held():
                self.launch(b, in_backward=False)
        self.wait()

    def zero_(self) -> None:
        for s in self.shards:
            s.zero_()
        self.rounds = []
