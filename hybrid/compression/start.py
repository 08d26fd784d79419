"""Where PowerSGD starts: its ranks and first Qs from the exact warm-up's last DP mean.

PowerSGD's factors warm-start from the previous step's Q, and the adaptive rank (`adaptive_rank.py`) grows a
matrix's rank by doubling, once per `compression.rank_window` steps. Started cold — a random Q, every matrix at
`compression.rank` — the first compressed steps send the run's worst approximations, early in AdamW's run where
each step moves the weights most: a matrix that needs rank 16 spends 20 steps getting there.

The exact warm-up already holds what is needed, on every DP rank alike: its last step's all-reduced mean M̄ of
each compressed matrix. Its singular values give the error each rank would have (√(Σ dropped σ²/Σ σ²)), so the
controller starts each matrix at the least rank meeting `compression.target_error` but not below
`compression.rank`, trimmed to the byte budget where the columns hold the least energy per byte, down to
`compression.rank` (`RankControl.start_from`); its leading right singular vectors are the first Q (a fixed rank
keeps `compression.rank` and gets the Q). The floor matters: early gradients need fewer directions than the next
steps' (gpt-tiny's tied embedding: rank 1 at its second step, 0.42 error at rank 1-2 ten steps on), and a rank
started below the cold start's grows back only by doubling, a window at a time. No collective: every rank holds the same
M̄, bit for bit, and decomposes it alike (the range finder's random start from a seed they share). The cost, once
per run on the last exact step: per compressed matrix a randomized range finder (Halko, Martinsson & Tropp, 2011)
of its leading cap + `OVERSAMPLE` directions with `ITERATIONS` power iterations, O(n·m·(cap + 8)) — a full SVD of
a 2,048 × 8,192 matrix took 27 s on one CPU thread. Under `schedule=auto`, where that step is not known in
advance, the rank starts at `compression.rank` as before; a resumed run keeps the ranks and Qs its checkpoint
holds.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid.compression.adaptive_rank import rank_cap
from hybrid.compression.powersgd import PowerSGDState, orthonormal, split
from hybrid.parallel import collectives as C

OVERSAMPLE, ITERATIONS = 8, 2
"""The range finder's columns beyond the largest rank a matrix may start at, and its power iterations (each one
M·Q and Mᵀ·P): enough for the leading singular values to a fraction of a percent where they decay."""


def warm_start(state: Any, bucket: Any) -> None:
    """On the last exact step, with `bucket` holding the exact DP mean: start the method whose `state` this is
    from it (PowerSGD: `start_from_mean`); other methods have nothing to start."""
    if isinstance(state, PowerSGDState):
        start_from_mean(state, bucket)


def start_from_mean(st: PowerSGDState, bucket: Any) -> None:
    """`bucket`'s compressed matrices' ranks (adaptive: `RankControl.start_from`; fixed: `st.rank`) and first Qs,
    their leading right singular vectors, from the exact mean the bucket holds."""
    if C.size(st.group) == 1:
        return
    _, views, exact = split(st, bucket)
    if not views:
        return
    idx, shapes = bucket.index(), [tuple(v.shape) for v in views]
    ctl = st.control
    widths = [rank_cap(s, ctl.max_rank, ctl.min_rate) if ctl else min(st.rank, *s) for s in shapes]
    gen = torch.Generator().manual_seed((st.seed * 1_000_003 + idx) * 7_919)
    found = [leading(v, k, gen) for v, k in zip(views, widths)]
    if ctl is not None:
        ranks = ctl.start_from(idx, [sq for sq, _ in found], shapes, sum(e.numel() for e in exact))
    else:
        ranks = st.ranks(idx, shapes)
    st.q[idx] = [right[:, :r].contiguous() for (_, right), r in zip(found, ranks)]


def leading(m: torch.Tensor, k: int, gen: torch.Generator) -> tuple[list[float], torch.Tensor]:
    """`m`'s leading w = min(k + OVERSAMPLE, n, m) directions by a randomized range finder: ([σ₁², …, σ_w², the
    energy beyond them], the right singular vectors as columns, m × w). Exact where w reaches min(n, m)."""
    m = m.float()
    width = min(k + OVERSAMPLE, *m.shape)
    q = torch.randn(m.shape[1], width, generator=gen).to(m.device)
    for _ in range(ITERATIONS):
        q = orthonormal(m.t() @ orthonormal(m @ q))
    _, s, wh = torch.linalg.svd(m @ q, full_matrices=False)
    squares = s.pow(2)
    rest = max(0.0, float(m.pow(2).sum() - squares.sum()))
    return [*squares.tolist(), rest], q @ wh.t()

