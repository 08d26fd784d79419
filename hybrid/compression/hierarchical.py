"""Hierarchical sync: exact inside a node over the fast links, compressed between nodes.

With r ranks per node (the DP group's part on one node, `ParallelContext.dp_intra_group`) and
the bucket cut into r row-aligned ranges of about N/r elements each:

  1. **reduce-scatter** inside the node (exact fp32 sum): local rank j gets range j summed over
     its node;
  2. the inner method (int8, sign, top-k, PowerSGD, …) averages range j over the nodes, over
     `dp_inter_group` (the ranks with the same local index on every node), so each inter-node
     link carries 1/r of the bucket, compressed;
  3. **all-gather** inside the node shares the ranges; divide by r (node sums → global mean).

Ranges end on row boundaries of the gradients' matrix views, so the inner method still sees
matrices (PowerSGD compresses row blocks of a weight; a row block of a low-rank matrix is low
rank). Ranges are padded to the longest for the equal-size collectives. Counted payload: the
intra group 2·4·r·L_max per bucket, the inter group the inner method's payload for range j (a
group of one rank sends nothing: one node, or one rank per node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid.compression.codecs import done
from hybrid.compression.powersgd import matrix_shape
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

Range = tuple[int, int]


def row_ranges(shapes: list[torch.Size], parts: int) -> list[Range]:
    """`parts` consecutive [start, end) offsets of the flat bucket, cut at row boundaries."""
    rows = []  # (offset, rows, width) of each gradient's matrix view
    offset = 0
    for s in shapes:
        n, w = matrix_shape(s)
        rows.append((offset, n, w))
        offset += s.numel()
    cuts = [0]
    for j in range(1, parts):
        target = j * offset // parts
        for o, n, w in rows:
            if o <= target < o + n * w:
                target = o + round((target - o) / w) * w
                break
        cuts.append(max(cuts[-1], target))
    return list(zip(cuts, cuts[1:] + [offset]))


def piece_shapes(shapes: list[torch.Size], rng: Range) -> list[torch.Size]:
    """The (rows, width) shapes of the gradients' row blocks that fall inside `rng`."""
    return [piece for _, piece in pieces(shapes, rng)]


def pieces(shapes: list[torch.Size], rng: Range) -> list[tuple[int, torch.Size]]:
    """(index of the gradient, the (rows, width) shape of its row block) for each block inside `rng`."""
    out, offset = [], 0
    for i, s in enumerate(shapes):
        _, w = matrix_shape(s)
        lo, hi = max(rng[0], offset), min(rng[1], offset + s.numel())
        if hi > lo:
            out.append((i, torch.Size([(hi - lo) // w, w])))
        offset += s.numel()
    return out


class SubBucket:
    """One range of a bucket as a bucket of its own (the protocol the inner hook sees): its gradients are the
    row blocks in the range, its parameters those blocks' parameters, in the same order."""

    def __init__(self, parent: Any, buffer: torch.Tensor, blocks: list[tuple[int, torch.Size]]) -> None:
        self._parent, self._buffer = parent, buffer
        params = parent.parameters()
        self._params = [params[i] for i, _ in blocks]
        self._views, offset = [], 0
        for _, s in blocks:
            self._views.append(buffer[offset: offset + s.numel()].view(s))
            offset += s.numel()

    def index(self) -> int:
        return self._parent.index()

    def is_last(self) -> bool:
        return self._parent.is_last()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


@dataclass
class HierarchicalState:
    intra: Group
    inter: Group
    inner_hook: Any
    inner_state: Any
    ranges: dict[tuple[int, int], list[Range]] = field(default_factory=dict)

    def bucket_setting(self, index: int) -> dict[str, float]:
        """The inner method's error-budget figures of bucket `index` (this rank's range of it)."""
        setting = getattr(self.inner_state, "bucket_setting", None)
        return setting(index) if setting is not None else {}

    def state_dict(self) -> dict[str, Any]:
        sd = getattr(self.inner_state, "state_dict", None)
        return {"inner": sd() if sd else {}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if hasattr(self.inner_state, "load_state_dict"):
            self.inner_state.load_state_dict(sd["inner"])


def _value(fut: torch.futures.Future, group: str) -> torch.Tensor:
    """The inner method's result, waited for on the training thread (exposed time of `group`)."""
    with C.TIMER.waiting(group):
        v = fut.wait()
    return v[0] if isinstance(v, list) else v


def hierarchical_hook(st: HierarchicalState, bucket: Any) -> torch.futures.Future:
    """reduce-scatter (node) → inner method (between nodes) → all-gather (node); see module doc."""
    buf = bucket.buffer()
    r, j = C.size(st.intra), C.rank(st.intra)
    shapes = [g.shape for g in bucket.gradients()]
    key = (bucket.index(), buf.numel())
    if key not in st.ranges:
        st.ranges[key] = row_ranges(shapes, r)
    ranges = st.ranges[key]
    longest = max(b - a for a, b in ranges)
    padded = torch.zeros(r, longest, dtype=buf.dtype, device=buf.device)
    for k, (a, b) in enumerate(ranges):
        padded[k, : b - a] = buf[a:b]
    mine = torch.empty(longest, dtype=buf.dtype, device=buf.device)
    C.reduce_scatter_flat(mine, padded.view(-1), st.intra)
    a, b = ranges[j]
    sub = SubBucket(bucket, mine[: b - a], pieces(shapes, ranges[j]))
    result = _value(st.inner_hook(st.inner_state, sub), C.group_name(st.inter))  # waited: the next one is ordered
    if result.data_ptr() != sub.buffer().data_ptr():
        sub.buffer().copy_(result)
    mine.div_(r)
    gathered = torch.empty_like(padded)
    work = C.all_gather_flat(gathered.view(-1), mine, st.intra, async_op=True)

    def unpad(_: Any = None) -> torch.Tensor:
        for k, (a, b) in enumerate(ranges):
            buf[a:b] = gathered[k, : b - a]
        return buf

    return done(unpad()) if work is None else work.get_future().then(unpad)
