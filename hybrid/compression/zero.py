"""What the distributed optimizer's gradient reduce-scatter (`parallel.zero=1|2`) can run of `compression`.

A reduce-scatter leaves each DP rank the mean of its own shard of a bucket, so a method can run there only if
it needs no whole bucket and keeps no whole bucket across steps: a plain dtype (fp32, fp16, bf16) or a codec without
error feedback (int8, int4) as an encoded all-to-all (`reduce_scatter_encoded`) — over a shard group that
spans nodes in two hops, exact inside the node and encoded across (`TwoHop`, ZeRO++'s qgZ).
PowerSGD, sign, top-k, DGC, 1-bit Adam and hierarchical exchanges are refused by `validate` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hybrid.compression import codecs
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

REDUCE_SCATTER_DTYPES: dict[str, torch.dtype] = {"none": torch.float32, "fp16": torch.float16,
                                                 "bf16": torch.bfloat16}
"""The methods the distributed optimizer (`parallel.zero=1|2`) runs as a reduce-scatter in a dtype."""

REDUCE_SCATTER_CODECS = ("int8", "int4")
"""The codecs the distributed optimizer runs as an encoded reduce-scatter (`reduce_scatter_encoded`): without
error feedback — no residual of a whole bucket survives from one step to the next —, but for qgZ's between-node
hop under `parallel.zero_grad_feedback` (a 1/node share of each bucket)."""

ZERO_METHODS = (*REDUCE_SCATTER_DTYPES, *REDUCE_SCATTER_CODECS)
"""Every method `parallel.zero=1|2` runs; the others need each bucket whole."""


def reduce_scatter_encoded(codec: codecs.Codec, buf: torch.Tensor, group: Group,
                           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The distributed optimizer's compressed reduce-scatter: step 1 and 2 of the exchange with the dp equal
    shards of `buf` as the chunks — each shard encoded (padded to the codec's length), one **all-to-all** —,
    then this rank's shard is the sum of the decoded copies, written in place and returned. Step 3's
    re-encoding and step 4's gather are not needed: the optimizer all-gathers parameters instead. With a
    `residual` (error feedback, `buf`'s size) it is added to the shards before encoding and left holding what
    the encoding lost."""
    n = C.size(group)
    k = buf.numel() // n
    length = codec.chunk_len(k)
    shards = buf.view(n, k) if residual is None else buf.view(n, k) + residual.view(n, k)
    padded = shards if length == k else torch.nn.functional.pad(shards, (0, length - k))
    sent = torch.stack([codec.encode(c) for c in padded])
    if residual is not None:
        for c, e in enumerate(sent):
            torch.sub(shards[c], codec.decode(e, length)[:k], out=residual.view(n, k)[c])
    received = torch.empty_like(sent)
    C.all_to_all(received, sent, group)
    mine = buf[C.rank(group) * k: (C.rank(group) + 1) * k]
    mine.copy_(sum(codec.decode(e, length)[:k] for e in received))
    return mine


@dataclass
class OneHop:
    """ZeRO's encoded reduce-scatter over its shard group in one all-to-all (`reduce_scatter_encoded`)."""

    codec: codecs.Codec

    def __call__(self, buf: torch.Tensor, group: Group, index: int = 0) -> torch.Tensor:
        return reduce_scatter_encoded(self.codec, buf, group)


@dataclass
class TwoHop:
    """qgZ: ZeRO's reduce-scatter over a shard group that spans nodes, in two hops. Shard s of the group belongs
    to the rank at local index l = s mod L of node e = s div L (`node`: this rank's L ranks on its node,
    `across`: the ranks at its index on each of the E nodes). (1) an exact fp32 **reduce-scatter** over `node` of
    the shards laid out by local index: this rank gets its node's sum of the E shards of its index; (2) the
    codec's encoded **all-to-all** over `across` (`reduce_scatter_encoded`): the E node sums of its own shard,
    decoded and added. Only (2) leaves the node: the codec's payload of 1/L of the bucket. With `feedback` what
    (2)'s encoding lost of each bucket's node sums (1/L of the bucket, fp32, per rank) is kept and added to the
    bucket's next round (error feedback; not in checkpoints: a resume starts it at zero)."""

    codec: codecs.Codec
    node: Group
    across: Group
    feedback: bool = False
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, buf: torch.Tensor, group: Group, index: int = 0) -> torch.Tensor:
        """This rank's shard of the sum of `buf` over `group`, written in place (bucket `index`'s residual)."""
        n_node, n_across = C.size(self.node), C.size(self.across)
        k = buf.numel() // (n_node * n_across)
        by_index = buf.view(n_across, n_node, k).transpose(0, 1).contiguous()  # [l, e, k]
        part = torch.empty(n_across * k, dtype=buf.dtype, device=buf.device)
        C.reduce_scatter_flat(part, by_index.view(-1), self.node)
        del by_index
        reduce_scatter_encoded(self.codec, part, self.across, self._residual(index, part))
        mine = buf[C.rank(group) * k: (C.rank(group) + 1) * k]
        return mine.copy_(part[C.rank(self.across) * k: (C.rank(self.across) + 1) * k])

    def _residual(self, index: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.feedback:
            return None
        r = self.residuals.get(index)
        if r is None or r.shape != like.shape:
            r = self.residuals[index] = torch.zeros_like(like)
        return r
