"""The error budget: per DP bucket, the compression error and the rank or density spent, in the metrics records.

Keys `compression/<bucket>/<figure>`, where <bucket> is `b<i>` (bucket i of the rank's `GradSync`) or, with
pipeline stages, `pp<s>.b<i>`; a bucket's figures cover all its TP and CP shards:

  error        ‖ĝ − g‖/‖g‖ of the bucket's averaged gradient (Σ over its shards), on the metered steps only
               (`compression.measure_every`: one exact, uncounted all-reduce per bucket)
  rank         PowerSGD: the mean rank of the bucket's compressed matrices (adaptive: the rank now)
  probe_error  PowerSGD with an adaptive rank: the last window's estimated error (free: no extra collective)
  density      top-k and DGC: the fraction of the elements sent

The hook state hands each bucket's figures (`bucket_figures()`); they ride in the metrics all-reduce of the
logged step as a fixed vector of pp × B slots (B the most buckets any rank holds, agreed once by an all-reduce
MAX on the first logged step, uncounted), each rank writing its stage's slots; sums of squared errors add
over shards, and the settings are averaged over the ranks that report them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

SUMMED = ("err_sq", "ref_sq")
AVERAGED = ("rank", "probe_error", "density")
WIDTH = len(SUMMED) + 2 * len(AVERAGED)  # the averaged ones with their count


class ErrorBudget:
    """The per-bucket slots of one rank (`pp_rank` of `pp_size` stages)."""

    def __init__(self, pp_rank: int, pp_size: int) -> None:
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.buckets: Optional[int] = None  # B: agreed on first use

    def vector(self, figures: dict[int, dict[str, float]], local: int, device: torch.device) -> list[float]:
        """This rank's slots: the figures of its `local` buckets at its stage, zeros elsewhere. Collective the
        first time (every rank calls it on the same logged step)."""
        b = self.agree(local, device)
        out = [0.0] * (self.pp_size * b * WIDTH)
        for i, figs in figures.items():
            at = (self.pp_rank * b + i) * WIDTH
            out[at: at + WIDTH] = row(figs)
        return out

    def agree(self, local: int, device: torch.device) -> int:
        """B, the most buckets a rank holds: one all-reduce MAX, the first time only."""
        if self.buckets is None:
            t = torch.tensor([float(local)], dtype=torch.float64, device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # metrics only: uncounted
            self.buckets = int(t.item())
        return self.buckets

    def record(self, sums: list[float]) -> dict[str, float]:
        """The `compression/<bucket>/<figure>` keys from the slots summed over the world."""
        out: dict[str, Any] = {}
        b = self.buckets or 0
        for slot in range(self.pp_size * b):
            name = f"pp{slot // b}.b{slot % b}" if self.pp_size > 1 else f"b{slot % b}"
            out |= {f"compression/{name}/{k}": v for k, v in figures(sums[slot * WIDTH: (slot + 1) * WIDTH]).items()}
        return out


def row(figs: dict[str, float]) -> list[float]:
    """One bucket's slot: the summed figures, then each averaged one and a count of 1 where present."""
    out = [figs.get(k, 0.0) for k in SUMMED]
    for k in AVERAGED:
        out += [figs[k], 1.0] if k in figs else [0.0, 0.0]
    return out


def figures(slot: list[float]) -> dict[str, float]:
    """A summed slot's figures: the error where a meter ran, the averages where any rank reported one."""
    err, ref = slot[0], slot[1]
    out = {"error": math.sqrt(err / ref)} if ref > 0 else {}
    for j, k in enumerate(AVERAGED):
        total, count = slot[2 + 2 * j], slot[3 + 2 * j]
        if count:
            out[k] = total / count
    return out
