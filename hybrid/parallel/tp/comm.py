"""TP's exchanges when they overlap computation (`parallel.tp_overlap`): the async collectives of the bulk overlap
and the ring pipelines of the chunked one.

Bulk (`start_gather_seq`, `start_reduce_scatter_seq`, `start_all_reduce`): the blocking region op's own call,
launched asynchronously (gloo runs it on its own thread, NCCL on its own stream) and waited for later with
`Pending.wait()`, so its result is bit for bit the blocking one's; the thread's wait is the TP group's exposed time.

Chunked: the sequence is cut into n·m pieces (n TP ranks, m `lanes` per rank) that travel one hop per step around
the TP ring (`hops.Ring`: async point-to-point, so gloo and NCCL alike) while the pieces in hand are computed on:

- `gather_each(x, group, use, op, lanes)`, all-gather → compute: at step k rank r holds rank (r − k) mod n's
  pieces, posts their hop to r + 1 and runs `use(piece, rows)` on each while it travels; n − 1 hops.
- `reduce_scatter_each(make, length, group, lanes)`, compute → reduce-scatter: at step k rank r makes its partial
  sums for rank j = (r − k − 1) mod n's pieces (`make(rows)`), adds the running sums that arrived from r − 1 and
  passes them on; at step n − 1 it made its own pieces' partials and their sums are complete; n − 1 hops.

`rows` is a piece's place along the whole sequence: the slice [i·q, (i + 1)·q), i = rank · m + lane,
q = s / (n·m). Each ring is counted once, as the collective it replaces with its whole payload, so the
TP group's bytes are the blocking run's; its hops put (n − 1)/n of that payload on the wire per rank — the
collective's bus bytes. A sum made around the ring adds in another order than gloo's or NCCL's reduce-scatter:
equal within rounding. More lanes than one cut every hop and GEMM smaller; on a ring each hop still hides behind
the GEMMs of the same share of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.hops import Hop, Ring

OVERLAP_MODES = ("none", "bulk", "chunked")


@dataclass(frozen=True)
class TPOverlap:
    """How TP's exchanges meet its GEMMs: `mode` none (blocking), bulk (the backward's exchanges hidden behind the
    other gradient GEMM) or chunked (bulk, and under SP the forward's pipelined around the ring); `chunks`: pieces
    of the sequence under chunked (0: one per TP rank)."""

    mode: str = "bulk"
    chunks: int = 0

    @property
    def bulk(self) -> bool:
        return self.mode != "none"

    @property
    def chunked(self) -> bool:
        return self.mode == "chunked"

    def lanes(self, tp: int) -> int:
        """Pieces per TP rank's share of the sequence."""
        return max(self.chunks // tp, 1)


@dataclass
class Pending:
    """An async TP collective in flight; `wait()` returns its result (the time waited is exposed)."""

    group: Group
    op: str
    work: Optional[dist.Work]
    result: Callable[[], torch.Tensor]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with C.TIMER.waiting(C.group_name(self.group), self.op):
                self.work.wait()
        return self.result()


def start_gather_seq(x: torch.Tensor, group: Group, op: str = "regather") -> Pending:
    """`collectives.all_gather_seq` launched: every rank's [b, s/n, …] chunk, concatenated on `wait`."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(C.size(group))]
    C.count(group, op, _whole(x, len(parts)))
    work = C.timed(group, op, lambda: dist.all_gather(parts, x.contiguous(), group=group, async_op=True), True)
    return Pending(group, op, work, lambda: torch.cat(parts, dim=1))


def start_reduce_scatter_seq(t: torch.Tensor, group: Group) -> Pending:
    """`collectives.reduce_scatter_seq` launched: the sum of [b, s, …] over the group, this rank's [b, s/n, …]."""
    chunks = C.seq_chunks(t, C.size(group))
    out = torch.empty_like(chunks[0])
    C.count(group, "reduce_scatter", t)
    work = C.timed(group, "reduce_scatter", lambda: dist.reduce_scatter(out, chunks, group=group, async_op=True), True)
    return Pending(group, "reduce_scatter", work, lambda: out)


def start_all_reduce(t: torch.Tensor, group: Group) -> Pending:
    """`t` summed over the group in place (`copy_to_region`'s backward), launched."""
    return Pending(group, "all_reduce", C.all_reduce(t, group, async_op=True), lambda: t)


def gather_each(x: torch.Tensor, group: Group, use: Callable[[torch.Tensor, slice], None], op: str = "all_gather",
                lanes: int = 1) -> None:
    """All-gather → compute (see the module doc): `use(piece, rows)` on each of the n·m pieces of the sequence,
    this rank's [b, s/n, …] `x` among them, each while the next travels."""
    n, r = C.size(group), C.rank(group)
    q = pieces_of(x.shape[1] * n, n, lanes)
    C.count(group, op, _whole(x, n))
    ring, pieces = Ring(group, op), list(x.split(q, dim=1))
    for k in range(n):
        hops = [ring.start([p], counted=False) for p in pieces] if k < n - 1 else []
        for lane, piece in enumerate(pieces):
            use(piece, _slice((r - k) % n * lanes + lane, q))
        pieces = [hop.wait()[0] for hop in hops]


def reduce_scatter_each(make: Callable[[slice], torch.Tensor], length: int, group: Group, lanes: int = 1
                        ) -> torch.Tensor:
    """Compute → reduce-scatter (see the module doc): the sum over the group of `make(rows)` for this rank's
    pieces of a sequence of `length`, concatenated along it, each partial made while the running sums travel."""
    n, r = C.size(group), C.rank(group)
    q = pieces_of(length, n, lanes)
    ring, hops = Ring(group, "reduce_scatter"), []
    for k in range(n):
        sums = [make(_slice((r - k - 1) % n * lanes + lane, q)) for lane in range(lanes)]
        sums = [_added(hop, s) for hop, s in zip(hops, sums)] if hops else sums
        hops = [ring.start([s], counted=False) for s in sums] if k < n - 1 else []
    out = torch.cat(sums, dim=1) if lanes > 1 else sums[0]
    C.count(group, "reduce_scatter", _whole(out, n))
    return out


def _added(hop: Hop, partial: torch.Tensor) -> torch.Tensor:
    """The running sum that arrived, plus this rank's partial."""
    return hop.wait()[0].add_(partial)


def _whole(t: torch.Tensor, n: int) -> torch.Tensor:
    """A view of n copies of `t`: the payload a collective over n ranks of `t`'s pieces counts (no copy)."""
    return t.unsqueeze(0).expand(n, *t.shape)


def pieces_of(length: int, n: int, lanes: int) -> int:
    """Tokens per piece of a sequence of `length` cut into n·lanes pieces (ValueError where it does not divide)."""
    _check_divides(length, n * lanes, "the TP overlap's chunks" if lanes > 1 else "the TP size")
    return length // (n * lanes)


def _slice(index: int, size: int) -> slice:
    return slice(index * size, (index + 1) * size)


def _check_divides(length: int, parts: int, what: str) -> None:
    if length % parts:
        raise ValueError(f"sequence length {length} does not divide by {what} ({parts})")
