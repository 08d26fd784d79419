"""What the distributed optimizer's gradient reduce-scatter (`parallel.zero=1|2`) can run of `compression`.

A reduce-scatter leaves each DP rank the mean of its own shard of a bucket, so a method can run there only if
it needs no whole bucket and keeps nothing across steps: a plain dtype (fp32, fp16, bf16) or a codec without
error feedback (int8, int4) as an encoded all-to-all (`codecs.reduce_scatter_encoded`). PowerSGD, sign, top-k, DGC,
1-bit Adam and hierarchical exchanges are refused by `validate` with one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch

from hybrid.compression import codecs
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

REDUCE_SCATTER_DTYPES: dict[str, torch.dtype] = {"none": torch.float32, "fp16": torch.float16,
                                                 "bf16": torch.bfloat16}
"""The methods the distributed optimizer (`parallel.zero=1|2`) runs as a reduce-scatter in a dtype."""

REDUCE_SCATTER_CODECS = ("int8", "int4")
"""The codecs the distributed optimizer runs as an encoded reduce-scatter (`codecs.reduce_scatter_encoded`):
without error feedback, so no residual must survive from one step to the next."""

ZERO_METHODS = (*REDUCE_SCATTER_DTYPES, *REDUCE_SCATTER_CODECS)
"""Every method `parallel.zero=1|2` runs; the others need each bucket whole."""


def encoded_reduce_scatter(cfg: CompressionConfig) -> Optional[Callable[[torch.Tensor, Group], torch.Tensor]]:
    """ZeRO's reduce-scatter through `cfg`'s codec (int8, int4: `codecs.reduce_scatter_encoded`), or None (a plain
    one, in `REDUCE_SCATTER_DTYPES`' dtype)."""
    if cfg.method not in REDUCE_SCATTER_CODECS:
        return None
    return functools.partial(codecs.reduce_scatter_encoded, codecs.CODECS[cfg.method].build(cfg))
