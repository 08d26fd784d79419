"""Lookup rows (`compression.lookup_rows`): PowerSGD sends a lookup table's touched rows, exactly, when cheaper.

An untied token embedding is read only by its lookup: a step's gradient holds a row for each id the step saw and
zeros elsewhere (llama-tiny, 8,192 rows, 512 tokens a step: ~240 rows). Its rows are independent directions, so
PowerSGD's factors approximate it badly — on llama-tiny its error stayed at 0.5-0.9 for the whole run while every
other matrix settled at 0.1-0.4 — yet the touched rows themselves cost about what the factors do.

Per step and PowerSGD bucket holding such a table (`PowerSGDState.lookups`, parameter ids the trainer sets):
  1. each rank's mask of the table's nonzero gradient rows (before error feedback is added), and one
     **all-reduce** (MAX, uint8: n bytes a table, every table of the bucket in one call) — the union U of the rows
     any DP rank touched, the same on every rank;
  2. where |U|·m + n/4 elements cost no more than its factors would ((n + m)·r) — under the adaptive rank, with
     its error probe and its share of what the bucket's byte budget has left — its rows U, with their error
     feedback, ride in PowerSGD's first all-reduce and arrive as the exact DP mean; the other rows get nothing
     this step and keep their residual, U's rows keep none (the ranks' deviations from the mean sum to zero).
     Otherwise the table goes as factors, as any matrix.
Apart from the mask (n bytes, paid on every step), a bucket never sends more than its factors or its byte budget
allow. Every DP rank decides alike (U is all-reduced), so the replicas stay equal. On llama-tiny it halves
PowerSGD's error; the eval loss after 200 steps did not move beyond its noise (docs/compression.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

MASK_ELEMENTS = 0.25  # a mask's byte per row, counted in fp32 elements


def touched(view: torch.Tensor) -> torch.Tensor:
    """The rows of a gradient matrix holding anything but zeros (uint8 0/1)."""
    return view.ne(0).any(dim=1).to(torch.uint8)


def union(masks: Sequence[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """The indices of the rows any rank of `group` touched, per mask: one **all-reduce** (MAX) of the masks."""
    flat = torch.cat(list(masks))
    C.all_reduce(flat, group, op=dist.ReduceOp.MAX)
    return [part.nonzero().flatten() for part in flat.split([m.numel() for m in masks])]


def fits(rows: int, shape: tuple[int, int], allowance: float) -> bool:
    """Whether `rows` rows of an (n, m) table and its mask cost no more than `allowance` elements."""
    n, m = shape
    return rows * m + MASK_ELEMENTS * n <= allowance


def plan(views: Sequence[torch.Tensor], lookup: Sequence[bool], allowances: Sequence[float],
         group: Group) -> list[Optional[torch.Tensor]]:
    """Per view: the union's row indices when it goes as rows, None when as factors. One all-reduce when any
    view is a lookup table, none otherwise."""
    at = [i for i, is_lookup in enumerate(lookup) if is_lookup]
    out: list[Optional[torch.Tensor]] = [None] * len(views)
    if not at:
        return out
    for i, rows in zip(at, union([touched(views[i]) for i in at], group)):
        out[i] = rows if fits(rows.numel(), tuple(views[i].shape), allowances[i]) else None
    return out


def payload_elements(shape: tuple[int, int], rows: int) -> float:
    """Elements a table sent as `rows` rows counts: the rows and its mask (n bytes)."""
    return rows * shape[1] + MASK_ELEMENTS * shape[0]
