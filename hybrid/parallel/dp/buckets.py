"""DP gradient buckets: which parameters share a flat fp32 buffer, and the view a comm hook gets of one.

`assign_buckets` groups the parameters in reverse registration order (the order their gradients become
final in the backward) into buckets of about `parallel.bucket_mb`, each holding one sync class
(`sync_class`) and, apart, the parameters a compression keeps exact. `GradBucket` is what
`torch.distributed.GradBucket` offers a DDP comm hook, over one such buffer. Under ZeRO a bucket's
buffer is `padded_numel` long: dp equal shards of a multiple of `SHARD_ALIGN` elements.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hybrid.parallel.params import param_info

SHARD_ALIGN = 32
"""ZeRO-1: elements per shard are a multiple of this (fp32: 128 bytes)."""

class GradBucket:
    """What `torch.distributed.GradBucket` offers a comm hook, over one flat fp32 buffer. Under ZeRO-2 the
    buffer is transient (`numel` given, no buffer): attached for one microbatch's gradients, released to be
    reduce-scattered (`attach`, `release`)."""

    def __init__(self, index: int, buffer: Optional[torch.Tensor], params: list[nn.Parameter], is_last: bool,
                 numel: Optional[int] = None) -> None:
        self._index, self._params, self._is_last = index, params, is_last
        self._numel = buffer.numel() if buffer is not None else int(numel or 0)
        self._offsets = [0]
        for p in params[:-1]:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._buffer: Optional[torch.Tensor] = None
        self._views: list[torch.Tensor] = []
        if buffer is not None:
            self.attach(buffer)

    def attach(self, buffer: torch.Tensor) -> None:
        """Hold `buffer` (`numel()` elements) and cut each parameter's gradient view of it."""
        self._buffer = buffer
        self._views = [buffer[at: at + p.numel()].view_as(p) for p, at in zip(self._params, self._offsets)]

    def release(self) -> torch.Tensor:
        """Hand the buffer over and hold none (its views go with it)."""
        buffer, self._buffer, self._views = self._buffer, None, []
        assert buffer is not None, "a released bucket holds no buffer"
        return buffer

    def index(self) -> int:
        return self._index

    def offsets(self) -> list[int]:
        """Where each parameter starts in the buffer, in `parameters()` order."""
        return list(self._offsets)

    def numel(self) -> int:
        """The buffer's length (padded to dp shards under ZeRO), whether or not one is held now."""
        return self._numel

    def buffer(self) -> torch.Tensor:
        assert self._buffer is not None, "the bucket holds no buffer now (ZeRO-2 between microbatches)"
        return self._buffer

    def held(self) -> bool:
        return self._buffer is not None

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self.buffer().copy_(tensor)


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int,
                   apart: frozenset[int] = frozenset()) -> list[list[nn.Parameter]]:
    """Split parameters, in reverse registration order, into buckets of about `bucket_bytes` (fp32), each
    split again by `sync_class` and by membership in `apart` (ids: parameters the hook keeps exact), the
    parts in the order they start."""
    buckets: list[list[nn.Parameter]] = [[]]
    filled = 0
    for p in reversed(params):
        if buckets[-1] and filled + 4 * p.numel() > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += 4 * p.numel()
    return [part for b in buckets for part in _by_class(b, apart)]


def shard_span(offset: int, n: int, start: int, k: int) -> tuple[int, int]:
    """The range `[lo, hi)` of a parameter's flattened elements (`n` of them, at `offset` in its bucket) that lies
    in the bucket's shard `[start, start + k)`; empty (lo == hi) when none does."""
    lo, hi = max(offset, start), min(offset + n, start + k)
    return lo - offset, max(lo, hi) - offset


def assign_units(units: list[list[nn.Parameter]], bucket_bytes: int,
                 apart: frozenset[int] = frozenset()) -> list[list[nn.Parameter]]:
    """Under ZeRO: each unit's parameters (a block, a chunk's root) bucketed alone by `assign_buckets`, the last
    unit's first (the order the backward finishes them). ZeRO-3 gathers and frees a bucket with its unit; ZeRO-1
    and 2 lay their buckets out alike, so the three stages shard, reduce and sum in the same order."""
    return [b for unit in reversed(units) for b in assign_buckets(unit, bucket_bytes, apart)]


def padded_numel(numel: int, dp: int) -> int:
    """A sharded bucket's length: `numel` rounded up so that each of the dp shards holds a multiple of
    `SHARD_ALIGN` elements (equal shards for the reduce-scatter and all-gather; 128-byte aligned)."""
    unit = dp * SHARD_ALIGN
    return -(-numel // unit) * unit


def sync_class(p: nn.Parameter) -> int:
    """A bucket holds one class: TP-sharded (0), a pipeline-tied embedding copy (1), TP-replicated (2).

    Lossy compression is a deterministic function of a bucket's values, so a bucket whose every element is
    the same on the ranks that must stay equal (the TP ranks for replicated parameters, the first and last
    stage for a tied embedding under 1-bit Adam) is compressed the same there and they stay equal; mixed
    with TP shards, each TP rank's copy of a norm would take another rounding and drift apart."""
    info = param_info(p)
    if info.pp_tied or info.pp_duplicate:
        return 1
    return 0 if info.shard is not None else 2


def _by_class(bucket: list[nn.Parameter], apart: frozenset[int]) -> list[list[nn.Parameter]]:
    parts: dict[tuple[int, bool, int], list[nn.Parameter]] = {}
    for p in bucket:
        alone = id(p) if sync_class(p) == 1 else 0  # two tied copies on one rank (a V placement): one bucket each
        parts.setdefault((sync_class(p), id(p) in apart, alone), []).append(p)
    return list(parts.values())
