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
M̄, bit for bit, and decomposes it alike. The cost is one SVD per compressed matrix, once per run (the last
exact step; under `schedule=auto`, where that step is not known in advance, the rank starts at
`compression.rank` as before, and a resumed run keeps the ranks and Qs its checkpoint holds).
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid.compression.powersgd import PowerSGDState, split
from hybrid.parallel import collectives as C


def warm_start(state: Any, bucket: Any) -> None:
    """On the last exact step, with `bucket` holding the exact DP mean: start the method whose `state` this is
    from it (PowerSGD: `start_from_mean`); other methods have nothing to start."""
    if isinstance(state, PowerSGDState):
        start_from_mean(state, bucket)


def start_from_mean(st: PowerSGDState, bucket: Any) -> None:
    """`bucket`'s compressed matrices' ranks (adaptive: `RankControl.start_from`; fixed: `st.rank`) and first Qs,
    their leading right singular vectors, from the exact mean the bucket holds."""
    _, views, exact = split(st, bucket)
    if not views or C.size(st.group) == 1:
        return
    svds = [torch.linalg.svd(v.float(), full_matrices=False) for v in views]
    shapes = [tuple(v.shape) for v in views]
    if st.control is not None:
        spectra = [s.pow(2).tolist() for _, s, _ in svds]
        ranks = st.control.start_from(bucket.index(), spectra, shapes, sum(e.numel() for e in exact))
    else:
        ranks = st.ranks(bucket.index(), shapes)
    st.q[bucket.index()] = [vh[:r].t().contiguous() for (_, _, vh), r in zip(svds, ranks)]
