"""The bandwidth bench behind `hybrid-commbench`: nccl-tests' collectives timed over process groups
(`bandwidth_table` prints the tables).

For each message size, every rank runs the same op over its own group (all groups of a kind at once,
aligned by a world barrier): `warmup` untimed calls, then `iters` timed calls; its time is the mean
per call. The per-rank times are all-gathered over the world once per table, so every rank knows the
minimum, mean and maximum; the bandwidths come from the maximum (the slowest rank, as nccl-tests).

- size: the bytes nccl-tests' `size` column counts, max(input, output) of one rank: the buffer of an
  all-reduce, a broadcast or a send/recv, the gathered output of an all-gather, the input of a
  reduce-scatter, the whole send buffer of an all-to-all.
- algbw = size / time; busbw = algbw · `bus_factor(op, n)` (all-reduce 2(n−1)/n; all-gather,
  reduce-scatter, all-to-all (n−1)/n; broadcast and send/recv 1), comparable with a link's peak.
- `#wrong`: the ranks fill their inputs with known rank-dependent values; after timing, one fresh call
  per column is compared element by element with the result computed locally from those values
  (summed over the ranks of the world). Timed calls are not checked (in-place ones accumulate).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.diagnostics import DiagnosticsError
from hybrid.parallel.collectives import bus_factor, dist_all_gather_single, dist_reduce_scatter_single

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
REDUCING = ("all_reduce", "reduce_scatter")  # filled with small values so that sums stay exact
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")  # sizes are whole multiples of n elements
NO_IN_PLACE = ("all_to_all", "send_recv")  # need distinct send and receive buffers
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64, "int8": torch.int8}
ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16", "int": "int32"}
ROOT = 0  # the broadcast's source: rank 0 of each group
SENTINEL = -1  # what an output holds before the op writes it (never a fill value)
CHECK_BLOCK = 1 << 22  # elements compared at a time


@dataclass(frozen=True)
class GroupSet:
    """All groups of one kind (world, tp, dp, …): every rank is in exactly one and measures over it.

    `ranks` lists every group's global ranks; `pg` is this rank's process group (None: the world)."""

    kind: str
    ranks: tuple[tuple[int, ...], ...]
    pg: Optional[dist.ProcessGroup] = None

    @property
    def size(self) -> int:
        return len(self.ranks[0])

    def mine(self) -> tuple[int, ...]:
        """The global ranks of this rank's group, as its process group reports them."""
        return tuple(dist.get_process_group_ranks(self.pg or dist.group.WORLD))

    def member(self) -> Member:
        return Member(self.pg, dist.get_rank(self.pg), self.mine())


@dataclass(frozen=True)
class Member:
    """This rank in its group of a kind, looked up once (not inside the timed loop)."""

    pg: Optional[dist.ProcessGroup]
    me: int  # position in the group
    ranks: tuple[int, ...]  # the group's global ranks

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Cell:
    """One column (out-of-place or in-place) of one size: time over the ranks, bandwidths, #wrong."""

    time_avg: float  # seconds per call, mean over ranks
    time_min: float
    time_max: float
    rank_min: int  # global rank of the fastest and of the slowest rank
    rank_max: int
    algbw: float  # GB/s from time_max
    busbw: float
    wrong: Optional[int]  # summed over ranks; None when the check is off


@dataclass(frozen=True)
class Row:
    size: int  # bytes (see the module doc)
    count: int  # elements in `size`
    out_of_place: Cell
    in_place: Optional[Cell]  # None for ops that need distinct buffers


@dataclass(frozen=True)
class Table:
    """One op over one group kind: a row per size."""

    op: str
    dtype: str
    groups: GroupSet
    rows: list[Row]

    @property
    def avg_busbw(self) -> float:
        """nccl-tests' "Avg bus bandwidth": the mean busbw of every cell of the table."""
        cells = [c for r in self.rows for c in (r.out_of_place, r.in_place) if c is not None]
        return statistics.fmean(c.busbw for c in cells) if cells else 0.0

    @property
    def wrong(self) -> int:
        return sum(c.wrong or 0 for r in self.rows for c in (r.out_of_place, r.in_place) if c is not None)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of `-d name`; raises DiagnosticsError."""
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise DiagnosticsError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def algbw(size: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second): the size moved per unit of time."""
    return size / seconds / 1e9 if seconds > 0 else 0.0


def busbw(op: str, n: int, size: int, seconds: float) -> float:
    """Bus bandwidth in GB/s: algbw scaled by nccl-tests' factor for `op` over `n` ranks."""
    return algbw(size, seconds) * bus_factor(op, n)


def element_count(op: str, nbytes: int, n: int, elem: int) -> int:
    """Elements in the size column for a requested size: rounded down to whole elements, and for the
    chunked ops to a multiple of n (one chunk per rank), at least one element per chunk."""
    count = nbytes // elem
    if op in CHUNKED:
        return max(n, count // n * n)
    return max(1, count)


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """minbytes, minbytes·factor, … up to maxbytes (nccl-tests' -b, -e, -f)."""
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(s)
        s *= factor
    return out


def value(op: str, group_rank: int | torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Element i of a group rank's input: small integers, exact in every dtype and in sums over many ranks
    ((r + i) mod 4 for the reductions), different per rank at each index ((7r + i) mod 61 otherwise)."""
    return (group_rank + i) % 4 if op in REDUCING else (7 * group_rank + i) % 61


def fill(op: str, group_rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The known input of a group rank."""
    return value(op, group_rank, torch.arange(numel)).to(dtype)


def _sum_over_ranks(op: str, n: int, i: torch.Tensor) -> torch.Tensor:
    """Σ over the n ranks of value(op, r, i), through the period 4 of the reductions' fill (O(len(i)))."""
    period = torch.arange(4)
    return sum((value(op, r, period) for r in range(n)), torch.zeros(4, dtype=torch.int64))[i % 4]


def expected(op: str, me: int, n: int, count: int, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
    """Positions lo:hi of what group rank `me` must hold after `op`, computed locally (float64) from every
    rank's fill (all of it by default)."""
    c = max(1, count // n)  # the chunk of the chunked ops (count may be below n for the others)
    j = torch.arange(lo, hi if hi is not None else c if op == "reduce_scatter" else count)  # output positions
    src, k = j // c, j % c  # chunked ops: the rank a position comes from, and its index in that chunk
    results = {
        "all_reduce": lambda: _sum_over_ranks(op, n, j),
        "all_gather": lambda: value(op, src, k),
        "reduce_scatter": lambda: _sum_over_ranks(op, n, me * c + j),
        "all_to_all": lambda: value(op, src, me * c + k),
        "broadcast": lambda: value(op, ROOT, j),
        "send_recv": lambda: value(op, (me - 1) % n, j),
    }
    return results[op]().double()


def count_wrong(got: torch.Tensor, want: torch.Tensor, n: int) -> int:
    """Elements of `got` that differ from `want` (NaN counts as wrong). Integers must match exactly;
    floats within n·eps·|want|, the rounding a sum over n ranks may add (the fills' sums are exact)."""
    diff = (got.detach().to("cpu", torch.float64) - want).abs()
    tol = n * torch.finfo(got.dtype).eps * want.abs() if got.dtype.is_floating_point else torch.zeros_like(want)
    return int((~(diff <= tol)).sum())


@dataclass
class Buffers:
    inp: torch.Tensor
    out: torch.Tensor  # where the result lands (a view into `inp` or the other way round when in place)


def buffers(op: str, me: int, n: int, count: int, dtype: torch.dtype, device: torch.device,
            in_place: bool) -> Buffers:
    """Fresh input and output of group rank `me`; in place as nccl-tests lays it out: the all-gather's
    input is this rank's chunk of the output, the reduce-scatter's output this rank's chunk of the input."""
    c, mine = count // n, slice(me * (count // n), (me + 1) * (count // n))
    inp = fill(op, me, c if op == "all_gather" else count, dtype).to(device)
    out_numel = c if op == "reduce_scatter" else count
    out = torch.full((out_numel,), SENTINEL, dtype=dtype, device=device)
    if not in_place:
        return Buffers(inp, out)
    if op == "all_gather":
        out[mine] = inp
        return Buffers(out[mine], out)
    if op == "reduce_scatter":
        return Buffers(inp, inp[mine])
    return Buffers(inp, inp)


def call(op: str, b: Buffers, m: Member, in_place: bool) -> None:
    """One collective over this rank's group. torch.distributed's all-reduce and broadcast work in place
    only, so their out-of-place call first copies the input into the output (as a caller must)."""
    pg, me, n = m.pg, m.me, m.size
    if op in ("all_reduce", "broadcast") and not in_place and (op == "all_reduce" or me == ROOT):
        b.out.copy_(b.inp)
    if op == "all_reduce":
        dist.all_reduce(b.out, group=pg)
    elif op == "all_gather":
        dist_all_gather_single(b.out, b.inp, group=pg)
    elif op == "reduce_scatter":
        dist_reduce_scatter_single(b.out, b.inp, group=pg)
    elif op == "all_to_all":
        dist.all_to_all_single(b.out, b.inp, group=pg)
    elif op == "broadcast":
        dist.broadcast(b.out, src=m.ranks[ROOT], group=pg)
    else:  # send_recv: the ring r → r+1 inside the group, both directions in one batch
        ops = [dist.P2POp(dist.isend, b.inp, m.ranks[(me + 1) % n], pg),
               dist.P2POp(dist.irecv, b.out, m.ranks[(me - 1) % n], pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def world_barrier(device: torch.device) -> None:
    """Align every rank of the world (a one-element all-reduce on the device, then a device sync), so
    that the groups of a kind start together."""
    dist.all_reduce(torch.zeros(1, device=device))
    synchronize(device)


def time_call(op: str, m: Member, count: int, dtype: torch.dtype, device: torch.device, in_place: bool,
              warmup: int, iters: int) -> float:
    """Seconds per call on this rank: `warmup` untimed calls, a world barrier, then the mean of `iters`."""
    b = buffers(op, m.me, m.size, count, dtype, device, in_place)
    for _ in range(warmup):
        call(op, b, m, in_place)
    world_barrier(device)
    start = time.perf_counter()
    for _ in range(iters):
        call(op, b, m, in_place)
    synchronize(device)
    return (time.perf_counter() - start) / iters


def check_call(op: str, m: Member, count: int, dtype: torch.dtype, device: torch.device, in_place: bool) -> int:
    """Wrong elements of one fresh call against the locally computed result, compared in blocks of
    CHECK_BLOCK elements (a few float64 temporaries of 32 MiB, whatever the size)."""
    b = buffers(op, m.me, m.size, count, dtype, device, in_place)
    call(op, b, m, in_place)
    synchronize(device)
    blocks = [(lo, min(lo + CHECK_BLOCK, b.out.numel())) for lo in range(0, b.out.numel(), CHECK_BLOCK)]
    return sum(count_wrong(b.out[lo:hi], expected(op, m.me, m.size, count, lo, hi), m.size) for lo, hi in blocks)


def gather_world(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Every rank's `values`, stacked [world, len(values)] (one all-gather over the world)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    dist_all_gather_single(out, mine)
    return out.view(dist.get_world_size(), len(values)).cpu()


def cell(op: str, n: int, size: int, times: torch.Tensor, wrong: torch.Tensor, check: bool) -> Cell:
    """Stats over the ranks of one column: `times` and `wrong` hold one value per global rank."""
    t_max = float(times.max())
    return Cell(time_avg=float(times.mean()), time_min=float(times.min()), time_max=t_max,
                rank_min=int(times.argmin()), rank_max=int(times.argmax()), algbw=algbw(size, t_max),
                busbw=busbw(op, n, size, t_max), wrong=int(wrong.sum()) if check else None)


def measure(op: str, g: GroupSet, byte_sizes: Sequence[int], dtype: torch.dtype, device: torch.device,
            warmup: int = 5, iters: int = 20, check: bool = True) -> Table:
    """The table of `op` over every group of `g` at once. Collective over the world: every rank calls it
    with the same arguments (its own group of the kind)."""
    if op not in OPS:
        raise DiagnosticsError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    elem = torch.empty(0, dtype=dtype).element_size()
    counts = sorted({element_count(op, s, g.size, elem) for s in byte_sizes})
    columns = (False,) if op in NO_IN_PLACE else (False, True)
    m = g.member()
    local: list[float] = []
    for count in counts:
        for in_place in columns:
            local.append(time_call(op, m, count, dtype, device, in_place, warmup, iters))
            local.append(check_call(op, m, count, dtype, device, in_place) if check else 0)
    every = gather_world(local, device).view(dist.get_world_size(), len(counts), len(columns), 2)
    rows = []
    for i, count in enumerate(counts):
        size = count * elem
        cells = [cell(op, g.size, size, every[:, i, j, 0], every[:, i, j, 1], check) for j in range(len(columns))]
        rows.append(Row(size, count, cells[0], cells[1] if len(cells) > 1 else None))
    return Table(op, dtype_name(dtype), g, rows)

