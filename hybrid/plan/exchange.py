"""The DP gradient exchange the links call for, per layout: flat, two hops (an exact reduce-scatter inside the
node, the exchange of 1/l of the gradients across nodes, an all-gather back inside: `compression=hierarchical
compression.inner=none`),
or two hops with int8 across nodes (`compression=hierarchical compression.inner=int8`; under ZeRO the encoded
two-hop reduce-scatter, `compression=int8`). Each is timed over the links its hops cross; the fastest is kept.

fp32 gradients; l = the DP ranks a node holds (a node's ranks over tp·cp), n = the nodes the DP group spans. The
int8 hop sends a quarter of the bytes plus block scales and costs the codec's passes over the gradients (encode,
decode, add: memory-bound, `CODEC_PASSES`). Two hops need the DP group to span nodes with more than one of its ranks
on each; a lossy exchange changes what is trained: the plan names it (docs/compression.md says when it keeps
quality).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid.plan.cost import collective_s
from hybrid.plan.hardware import Cluster

INT8_BYTES = 0.25 * 1.03  # an fp32 element as int8 plus its block's scale (block 128: 4 bytes over 128)
#: the int8 codec's encode, decode and add in copies of the fp32 gradients' bytes: absmax, divide, round, clamp,
#: cast, scales; cast back, multiply, add — measured 7.8 copies' time on this CPU (25 MB bucket, one thread)
CODEC_PASSES = 8


@dataclass(frozen=True)
class Exchange:
    method: str  # flat | hierarchical | int8
    seconds: float


def overrides(method: str, zero: int) -> list[str]:
    """The `hybrid.train` overrides of an exchange."""
    if method == "hierarchical":
        return ["compression=hierarchical", "compression.inner=none"]
    if method == "int8":
        return ["compression=int8"] if zero else ["compression=hierarchical", "compression.inner=int8"]
    return []


def options(dp: int, tp_cp: int, zero: int, elements: float, cluster: Cluster, bucket: float = 0.0
            ) -> list[Exchange]:
    """Every exchange this DP group can run, timed (`elements` gradient elements a rank), in buckets of `bucket`
    elements (`parallel.bucket_mb`), each its own exchange with its hops' latencies (0: one exchange of all)."""
    buckets = math.ceil(elements / bucket) if bucket else 1
    return [Exchange(e.method, e.seconds * buckets) for e in _one(dp, tp_cp, zero, elements / buckets, cluster)]


def _one(dp: int, tp_cp: int, zero: int, elements: float, cluster: Cluster) -> list[Exchange]:
    """Every exchange of `elements` gradient elements at once, timed."""
    payload, op = elements * 4, "reduce_scatter" if zero else "all_reduce"
    flat_link = cluster.intra if dp * tp_cp <= cluster.per_node else cluster.inter
    out = [Exchange("flat", collective_s(op, payload, dp, flat_link))]
    local = cluster.per_node // tp_cp if tp_cp <= cluster.per_node else 1
    if dp * tp_cp <= cluster.per_node or local < 2 or dp % local:
        return out
    nodes, inside = dp // local, _inside(payload, local, zero, cluster)
    if not zero:
        out.append(Exchange("hierarchical", inside + collective_s(op, payload / local, nodes, cluster.inter)))
    codec = CODEC_PASSES * elements * 4 / cluster.device.hbm
    out.append(Exchange("int8", inside + codec + collective_s(op, payload / local * INT8_BYTES, nodes, cluster.inter)))
    return out


def _inside(payload: float, local: int, zero: int, cluster: Cluster) -> float:
    """The hops inside the node: a reduce-scatter, and (without ZeRO) the all-gather that brings the sums back."""
    hops = collective_s("reduce_scatter", payload, local, cluster.intra)
    return hops if zero else hops + collective_s("all_gather", payload, local, cluster.intra)


def best(dp: int, tp_cp: int, zero: int, elements: float, cluster: Cluster, lossy: bool = True,
         bucket: float = 0.0) -> Exchange:
    """The fastest exchange (exact ones only unless `lossy`), in buckets of `bucket` elements (`options`)."""
    allowed = [e for e in options(dp, tp_cp, zero, elements, cluster, bucket) if lossy or e.method != "int8"]
    return min(allowed, key=lambda e: e.seconds)
