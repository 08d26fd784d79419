"""PowerSGD (Vogels et al., 2019): rank-r gradient factors with error feedback and warm start.

Per bucket, each gradient is viewed as a matrix M (n × m: its first dim × the rest). Those
worth compressing at rank r — (n + m)·r·min_compression_rate < n·m, PyTorch's rule — are
sent as two thin factors; the rest (biases, norms, small matrices) are sent exactly:

  1. P = M·Q with Q (m × r) warm-started from the previous step (re-orthonormalised);
  2. **all-reduce** [exact tensors ‖ all P] (sum), in one call;
  3. orthonormalise each P (QR: every rank gets the same P, so the same basis);
  4. Q = Mᵀ·P, **all-reduce** [all Q] (sum), divide by n;
  5. M̂ = P·Qᵀ is the mean's rank-r approximation, written into the bucket.

The residual M − M̂ (this rank's gradient minus the approximated mean) is added to the next
step's gradient. Counted payload per bucket (`payload_bytes`): 4·(exact elements + Σ (n + m)·r).
The first Q is random from a seed shared by the DP ranks, so every replica starts equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid.compression.codecs import done
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The (rows, cols) a gradient of `shape` is compressed as; a 0-d tensor is (1, 1)."""
    rows = shape[0] if len(shape) else 1
    return rows, (shape.numel() // rows if rows else 0)


def compressed_rank(shape: torch.Size, rank: int, min_rate: float) -> int:
    """The factor rank for a gradient of `shape`, 0 if it is sent exactly."""
    n, m = matrix_shape(shape)
    r = min(n, m, rank)
    return r if (n + m) * r * min_rate < n * m else 0


def payload_bytes(shapes: list[torch.Size], rank: int, min_rate: float) -> int:
    """Counted bytes of one bucket whose gradients have `shapes` (both all-reduces)."""
    total = 0
    for s in shapes:
        r = compressed_rank(s, rank, min_rate)
        total += sum(matrix_shape(s)) * r if r else s.numel()
    return 4 * total


@dataclass
class PowerSGDState:
    group: Group
    rank: int
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0
    residual: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # warm start per bucket

    def state_dict(self) -> dict[str, Any]:
        return {"residual": dict(self.residual), "q": {k: list(v) for k, v in self.q.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.residual = dict(sd["residual"])
        self.q = {k: list(v) for k, v in sd["q"].items()}


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


def _initial_qs(st: PowerSGDState, index: int, mats: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """Stored Qs re-orthonormalised, or fresh random ones from a seed every DP rank shares."""
    stored = st.q.get(index)
    if stored is not None and [q.shape for q in stored] == [(m.shape[1], r) for m, r in mats]:
        return [_orthonormal(q) for q in stored]
    gen = torch.Generator().manual_seed(st.seed * 1_000_003 + index)
    return [_orthonormal(torch.randn(m.shape[1], r, generator=gen).to(m.device)) for m, r in mats]


def powersgd_hook(st: PowerSGDState, bucket: Any) -> torch.futures.Future:
    """Rank-r PowerSGD of one bucket (see the module doc for the phases)."""
    buf, n, idx = bucket.buffer(), C.size(st.group), bucket.index()
    if n == 1:
        return done(buf)
    if st.error_feedback:
        r = st.residual.get(idx)
        if r is not None and r.shape == buf.shape:
            buf += r
        local = buf.clone()
    mats: list[tuple[torch.Tensor, int]] = []
    exact: list[torch.Tensor] = []
    for g in bucket.gradients():
        r = compressed_rank(g.shape, st.rank, st.min_compression_rate)
        if r:
            mats.append((g.view(matrix_shape(g.shape)), r))
        else:
            exact.append(g)
    qs = _initial_qs(st, idx, mats)
    ps = [m @ q for (m, _), q in zip(mats, qs)]
    parts = [e.reshape(-1) for e in exact] + [p.reshape(-1) for p in ps]
    flat = torch.cat(parts) if parts else buf.new_zeros(0)  # empty: a hierarchical range with no rows
    if flat.numel():  # every rank of the group has the same shapes, so all skip together
        C.all_reduce(flat, st.group)
    offset = 0
    for e in exact:
        e.copy_(flat[offset: offset + e.numel()].view_as(e) / n)
        offset += e.numel()
    if not mats:  # nothing worth compressing in this bucket: it went exactly
        if st.error_feedback:
            st.residual[idx] = local - buf
        return done(buf)
    for i, p in enumerate(ps):
        ps[i] = _orthonormal(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
    q_flat = torch.cat([(m.t() @ p).reshape(-1) for (m, _), p in zip(mats, ps)])
    work = C.all_reduce(q_flat, st.group, async_op=True)

    def decompress(_: Any) -> torch.Tensor:
        q_flat.div_(n)
        new_qs, offset = [], 0
        for (m, r), p in zip(mats, ps):
            q = q_flat[offset: offset + m.shape[1] * r].view(m.shape[1], r)
            m.copy_(p @ q.t())
            new_qs.append(q)
            offset += q.numel()
        st.q[idx] = new_qs
        if st.error_feedback:
            st.residual[idx] = local - buf
        return buf

    return work.get_future().then(decompress)
