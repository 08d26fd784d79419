"""The hooks that do not approximate beyond a cast: the exact mean (`compression=none`) and the 16-bit all-reduce
(`fp16`, `bf16`), in PyTorch DDP's protocol `hook(state, bucket) -> Future[Tensor]` (see `hooks.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybrid.compression.codecs import done
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group


def allreduce_hook(group: Group, bucket: Any) -> torch.futures.Future:
    """Exact mean: divide by the DP size, then one all-reduce (sum) of the whole bucket."""
    buf = bucket.buffer()
    buf.div_(C.size(group))
    work = C.all_reduce(buf, group, async_op=True)
    return done(buf) if work is None else work.get_future().then(lambda f: f.value()[0])


@dataclass
class CastState:
    group: Group
    dtype: torch.dtype


def cast_hook(st: CastState, bucket: Any) -> torch.futures.Future:
    """Mean in 16 bits: divide in fp32, cast, all-reduce (sum) the 16-bit copy, cast back.

    Dividing before the cast keeps the n-term sum inside fp16's range whenever each term is."""
    buf = bucket.buffer()
    low = (buf / C.size(st.group)).to(st.dtype)
    work = C.all_reduce(low, st.group, async_op=True)

    def back(_: Any = None) -> torch.Tensor:
        return buf.copy_(low)

    return done(back()) if work is None else work.get_future().then(back)
