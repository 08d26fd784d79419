"""PowerSGD (Vogels et al., 2019): rank-r gradient factors with error feedback and warm start.

Per bucket, each gradient is viewed as a matrix M (n × m: its first dim × the rest). Those
worth compressing at rank r — (n + m)·r·min_compression_rate < n·m, PyTorch's rule — are
sent as two thin factors; the rest (biases, norms, small matrices) are sent exactly:

  1. P = M·Q with Q (m × r) warm-started from the previous step (re-orthonormalised);
  2. **all-reduce** [exact tensors ‖ all P] (sum), in one call;
  3. orthonormalise each P (QR: every rank gets the same P, so the same basis);
  4. Q = Mᵀ·P, **all-reduce** [all Q] (sum), divide by n;
  5. M̂ = P·Qᵀ is the mean's rank-r approximation, written into the bucket.

With `compression.factor_dtype=bf16` (the default) P and Q travel in bfloat16 — P in an all-reduce of its own
beside step 2's fp32 one, Q divided by n before the cast — at half the bytes, so the same byte budget affords
twice the rank. bf16's rounding (at most 0.4 % of each element) is small beside a low-rank approximation's error
(10-60 %) and goes to the error feedback like it; every rank sums the same bf16 values, so every rank gets the same
P and Q.

The residual M − M̂ (this rank's gradient minus the approximated mean) is added to the next
step's gradient. A lookup table (an untied token embedding: `lookups`) may instead send the rows the step
touched, exactly, in step 2's all-reduce, when they cost no more than its factors (`rows.py`). Counted
payload per bucket (`payload_bytes`): 4·exact elements + b·Σ (n + m)·r, b = 4 (fp32 factors) or 2 (bf16).
The first Q is random from a seed shared by the DP ranks, so every replica starts equal.

With `compression.target_error > 0` (`control`, `adaptive_rank.py`) each matrix's rank follows its measured
error: a probe of min(n, m) floats per matrix rides in step 2's all-reduce, and the payload is
4·(exact + Σ min(n, m)) + b·Σ (n + m)·rᵢ with the ranks of that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.compression import rows as R
from hybrid.compression.adaptive_rank import RankControl, probe_size
from hybrid.compression.codecs import done
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

FACTOR_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""`compression.factor_dtype` → the dtype P and Q travel in."""


def factor_bytes(cfg: CompressionConfig) -> int:
    """Bytes per factor element on the wire under `cfg` (`payload_bytes`'s `factor_bytes`)."""
    return FACTOR_DTYPES[cfg.factor_dtype].itemsize


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The (rows, cols) a gradient of `shape` is compressed as; a 0-d tensor is (1, 1)."""
    rows = shape[0] if len(shape) else 1
    return rows, (shape.numel() // rows if rows else 0)


def compressed_rank(shape: torch.Size, rank: int, min_rate: float) -> int:
    """The factor rank for a gradient of `shape`, 0 if it is sent exactly."""
    n, m = matrix_shape(shape)
    r = min(n, m, rank)
    return r if (n + m) * r * min_rate < n * m else 0


def payload_bytes(shapes: list[torch.Size], rank: int, min_rate: float, ranks: Optional[list[int]] = None,
                  probed: bool = False, tables: Optional[dict[int, Optional[int]]] = None,
                  factor_bytes: int = 4) -> int:
    """Counted bytes of one bucket whose gradients have `shapes` (all its all-reduces): the matrices compressed at
    `rank` at `ranks` (in order; None: `rank`, capped by each shape), their factors `factor_bytes` an element, the
    rest exact, and with `probed` (adaptive rank) each compressed matrix's error probe. `tables`: compressed matrix
    i (in that order) → the rows it sent instead of factors, or None (`rows_sent`): each pays its mask, n bytes."""
    mats = [matrix_shape(s) for s in shapes if compressed_rank(s, rank, min_rate)]
    exact = sum(s.numel() for s in shapes if not compressed_rank(s, rank, min_rate))
    ranks = [min(rank, *m) for m in mats] if ranks is None else ranks
    tables = tables or {}
    factored = [i for i in range(len(mats)) if tables.get(i) is None]
    probes = sum(probe_size(mats[i]) for i in factored) if probed else 0
    rows = sum(k * mats[i][1] for i, k in tables.items() if k is not None)
    masks = sum(mats[i][0] for i in tables)
    factors = sum((mats[i][0] + mats[i][1]) * ranks[i] for i in factored)
    return 4 * (exact + probes + rows) + factor_bytes * factors + masks


@dataclass
class PowerSGDState:
    group: Group
    rank: int
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0
    control: Optional[RankControl] = None  # adaptive ranks (compression.target_error > 0); None: `rank` fixed
    factor_dtype: torch.dtype = torch.float32  # compression.factor_dtype: what P and Q travel in
    residual: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # warm start per bucket
    calls: dict[int, int] = field(default_factory=dict)  # bucket → steps compressed (the probes' seed)
    lookup_rows: bool = True  # compression.lookup_rows: a lookup table's touched rows instead of factors (`rows.py`)
    lookups: frozenset[int] = frozenset()  # ids of the lookup tables' parameters (set by the trainer)
    rows_sent: dict[int, dict[int, Optional[int]]] = field(default_factory=dict)  # bucket → its tables (by compressed
    # matrix position) → the rows each sent on the last step, None: factors (`payload_bytes`'s `tables`)

    def state_dict(self) -> dict[str, Any]:
        out = {"residual": dict(self.residual), "q": {k: list(v) for k, v in self.q.items()}}
        if self.control is not None:
            out |= {"control": self.control.state_dict(), "calls": dict(self.calls)}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.residual = dict(sd["residual"])
        self.q = {k: list(v) for k, v in sd["q"].items()}
        if self.control is not None and "control" in sd:
            self.control.load_state_dict(sd["control"])
            self.calls = dict(sd["calls"])

    def bucket_setting(self, index: int) -> dict[str, float]:
        """The error budget's figures of bucket `index` (`hybrid.record.error_budget`): its matrices' mean rank and,
        under an adaptive rank, the last window's estimated error."""
        fixed = [q.shape[1] for q in self.q.get(index, [])]
        ranks = self.control.ranks.get(index) if self.control is not None else fixed
        if not ranks:
            return {}
        out = {"rank": sum(ranks) / len(ranks)}
        if self.control is not None and index in self.control.errors:
            out["probe_error"] = self.control.figures(index)[1]
        return out

    def row_plan(self, bucket: Any, compressed: list[bool], views: list[torch.Tensor], ranks: list[int],
                 exact: int) -> list[Optional[torch.Tensor]]:
        """Per compressed view (`compressed`: which of the bucket's gradients are): the rows it sends instead of
        factors this step (`rows.plan`), or None. A table may cost its factors at its rank (and its error probe)
        and, under the adaptive rank, its share of what the bucket's byte budget has left."""
        ids = [id(p) for p, c in zip(bucket.parameters(), compressed) if c]
        lookup = [self.lookup_rows and i in self.lookups for i in ids]
        shapes = [tuple(v.shape) for v in views]
        room = 0.0
        if self.control is not None and any(lookup):
            room = max(0.0, self.control.room(bucket.index(), shapes, exact)) / sum(lookup)
        share = self.factor_dtype.itemsize / 4
        allowances = [(n + m) * r * share + (probe_size((n, m)) + room if self.control is not None else 0)
                      for (n, m), r in zip(shapes, ranks)]
        out = R.plan(views, lookup, allowances, self.group)
        self.rows_sent[bucket.index()] = {i: None if u is None else u.numel() for i, u in enumerate(out) if lookup[i]}
        return out

    def ranks(self, index: int, shapes: list[tuple[int, int]]) -> list[int]:
        """The ranks of bucket `index`'s compressed matrices: the controller's, or `rank` capped by each shape."""
        if self.control is not None:
            return self.control.ranks_of(index, shapes)
        return [min(self.rank, *s) for s in shapes]


def make(cfg: CompressionConfig, group: Group) -> tuple[Any, PowerSGDState]:
    """The registry's factory (`registry.REGISTRY`): the hook and its state for the `compression` config `cfg`."""
    dtype = FACTOR_DTYPES[cfg.factor_dtype]
    control = RankControl(cfg.rank, cfg.target_error, cfg.rank_window, cfg.min_ratio, cfg.max_rank,
                          cfg.min_compression_rate, dtype.itemsize / 4) if cfg.target_error > 0 else None
    return powersgd_hook, PowerSGDState(group, cfg.rank, cfg.error_feedback, cfg.min_compression_rate, cfg.seed,
                                        control, dtype, lookup_rows=cfg.lookup_rows)


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of `p`'s columns (reduced QR), the same on every rank for the same `p`."""
    return torch.linalg.qr(p, mode="reduced").Q


def _initial_qs(st: PowerSGDState, index: int, mats: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """Stored Qs re-orthonormalised, or fresh random ones from a seed every DP rank shares. A stored Q whose
    rank changed (adaptive rank) keeps its first columns, and a grown one gets random columns after them."""
    stored = st.q.get(index)
    if stored is not None and [q.shape[0] for q in stored] == [m.shape[1] for m, _ in mats]:
        if all(q.shape[1] >= r for q, (_, r) in zip(stored, mats)):
            return [orthonormal(q[:, :r]) for q, (_, r) in zip(stored, mats)]
        fresh = _random_qs(st, index, mats)
        return [orthonormal(torch.cat([q[:, :r], f[:, q.shape[1]:]], 1)) for q, f, (_, r) in zip(stored, fresh, mats)]
    return [orthonormal(q) for q in _random_qs(st, index, mats)]


def _random_qs(st: PowerSGDState, index: int, mats: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(st.seed * 1_000_003 + index)
    return [torch.randn(m.shape[1], r, generator=gen).to(m.device) for m, r in mats]


def _probes(st: PowerSGDState, index: int, mats: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """One random probe per matrix on its shorter side (adaptive rank), from a seed every DP rank shares."""
    if st.control is None:
        return []
    st.calls[index] = st.calls.get(index, 0) + 1
    gen = torch.Generator().manual_seed((st.seed * 1_000_003 + index) * 1_000_033 + st.calls[index])
    return [torch.randn(max(m.shape), generator=gen).to(m.device) for m, _ in mats]


def _sketch(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """This rank's probe of matrix `m`: Mᵀω when it has at least as many rows as columns, else Mω."""
    return m.t() @ w if m.shape[0] >= m.shape[1] else m @ w


def _probe_error(y: torch.Tensor, w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """(‖ȳ − M̂ᵀω‖², ‖ȳ‖²) (or with M̂ω) for M̂ = P·Qᵀ and ȳ the probe's DP mean."""
    approx = q @ (p.t() @ w) if p.shape[0] >= q.shape[0] else p @ (q.t() @ w)
    return float((y - approx).pow(2).sum()), float(y.pow(2).sum())


def powersgd_hook(st: PowerSGDState, bucket: Any) -> torch.futures.Future:
    """Rank-r PowerSGD of one bucket (see the module doc for the phases)."""
    buf, n, idx = bucket.buffer(), C.size(st.group), bucket.index()
    if n == 1:
        return done(buf)
    compressed, views, exact = split(st, bucket)
    ranks = st.ranks(idx, [tuple(v.shape) for v in views])
    rows = st.row_plan(bucket, compressed, views, ranks, sum(e.numel() for e in exact))  # before error feedback
    if st.error_feedback:
        r = st.residual.get(idx)
        if r is not None and r.shape == buf.shape:
            buf += r
        local = buf.clone()
    every = list(zip(views, ranks))
    qs_all, probes_all = _initial_qs(st, idx, every), _probes(st, idx, every)
    factored = [i for i, u in enumerate(rows) if u is None]
    mats, qs, probes = _pick(factored, every), _pick(factored, qs_all), _pick(factored, probes_all)
    sent = [(views[i], u) for i, u in enumerate(rows) if u is not None]
    ps = [m @ q for (m, _), q in zip(mats, qs)]
    sketches = [_sketch(m, w) for (m, _), w in zip(mats, probes)]
    head = [e.reshape(-1) for e in exact] + [v[u].reshape(-1) for v, u in sent]
    flat, p_sums, y_sums = _first_reduce(st, head, [p.reshape(-1) for p in ps], sketches, buf)
    offset = 0
    for e in exact:
        e.copy_(flat[offset: offset + e.numel()].view_as(e) / n)
        offset += e.numel()
    offset = _place_rows(sent, flat, offset, n)
    if not mats:  # nothing to factor in this bucket: it went exactly
        if st.error_feedback:
            st.residual[idx] = _residual(local, buf, sent)
        return done(buf)
    ps = [orthonormal(p_sums[o: o + p.numel()].view_as(p)) for p, o in zip(ps, _offsets(ps))]
    means = [y_sums[o: o + y.numel()] / n for o, y in zip(_offsets(sketches), sketches)]
    q_low = _factor_sum(torch.cat([(m.t() @ p).reshape(-1) for (m, _), p in zip(mats, ps)]), st.factor_dtype, n)
    work = C.all_reduce(q_low, st.group, async_op=True)

    def decompress(_: Any) -> torch.Tensor:
        q_flat = q_low.div(n) if q_low.dtype == torch.float32 else q_low.float()
        new_qs, offset = list(qs_all), 0
        for i, (m, r), p in zip(factored, mats, ps):
            q = q_flat[offset: offset + m.shape[1] * r].view(m.shape[1], r)
            m.copy_(p @ q.t())
            new_qs[i] = q
            offset += q.numel()
        st.q[idx] = new_qs
        if st.error_feedback:
            st.residual[idx] = _residual(local, buf, sent)
        if st.control is not None:
            errors = [(0.0, 0.0)] * len(every)  # a table sent as rows: exact, no estimate this step
            for i, y, w, p, q in zip(factored, means, probes, ps, (new_qs[i] for i in factored)):
                errors[i] = _probe_error(y, w, p, q)
            _adapt(st, idx, every, errors, factored, sum(e.numel() for e in exact))
        return buf

    return work.get_future().then(decompress)


def split(st: PowerSGDState, bucket: Any) -> tuple[list[bool], list[torch.Tensor], list[torch.Tensor]]:
    """Bucket's gradients sorted: which are compressed (PyTorch's rule at `st.rank`), their matrix views (of
    the bucket's buffer), and those sent exactly."""
    grads = bucket.gradients()
    compressed = [compressed_rank(g.shape, st.rank, st.min_compression_rate) > 0 for g in grads]
    views = [g.view(matrix_shape(g.shape)) for g, c in zip(grads, compressed) if c]
    return compressed, views, [g for g, c in zip(grads, compressed) if not c]


def _first_reduce(st: PowerSGDState, head: list[torch.Tensor], ps: list[torch.Tensor], sketches: list[torch.Tensor],
                  buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: **all-reduce** (sum) [exact tensors and rows ‖ P ‖ probes] in one fp32 call; under a 16-bit
    `factor_dtype` P goes in a second call of its own, in that dtype. Returns the sums (in fp32) of the head (exact
    tensors and rows), of the Ps and of the probes, each flat."""
    low = st.factor_dtype != torch.float32
    with_head = [] if low else ps  # the Ps that ride in the fp32 call
    parts = head + with_head + sketches
    flat = torch.cat(parts) if parts else buf.new_zeros(0)  # empty: a hierarchical range with no rows
    if flat.numel():  # every rank of the group has the same shapes, so all skip together
        C.all_reduce(flat, st.group)
    p_sums = torch.cat(ps).to(st.factor_dtype) if low and ps else buf.new_zeros(0)
    if p_sums.numel():
        C.all_reduce(p_sums, st.group)
    head_sums, fp32_ps, y_sums = flat.split([sum(t.numel() for t in ts) for ts in (head, with_head, sketches)])
    return head_sums, (p_sums.float() if low else fp32_ps), y_sums


def _factor_sum(q: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What step 4 all-reduces of this rank's Q: itself (fp32, divided by n after the sum), or Q / n cast to a 16-bit
    `dtype` (divided first, so the n-term sum stays in range wherever each term is)."""
    return q if dtype == torch.float32 else (q / n).to(dtype)


def _pick(at: list[int], items: list[Any]) -> list[Any]:
    """`items` at the positions `at` (none when `items` is empty: no probes at a fixed rank)."""
    return [items[i] for i in at] if items else []


def _place_rows(sent: list[tuple[torch.Tensor, torch.Tensor]], flat: torch.Tensor, offset: int, n: int) -> int:
    """Each table sent as rows: its union rows from `flat` (from `offset`, summed over n ranks) as the mean,
    zeros elsewhere; returns the offset after them."""
    for v, u in sent:
        k = u.numel() * v.shape[1]
        v.zero_()
        v[u] = flat[offset: offset + k].view(u.numel(), v.shape[1]) / n
        offset += k
    return offset


def _residual(local: torch.Tensor, buf: torch.Tensor, sent: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """This rank's error feedback: what it had minus what was applied; none on a table's sent rows (the ranks'
    deviations from their exact mean sum to zero)."""
    residual = local - buf
    for v, u in sent:
        view = residual[_span(buf, v)].view_as(v)
        view[u] = 0
    return residual


def _span(buf: torch.Tensor, v: torch.Tensor) -> slice:
    """The slice of `buf` that `v`, a view of it, covers."""
    start = v.storage_offset() - buf.storage_offset()
    return slice(start, start + v.numel())


def _adapt(st: PowerSGDState, idx: int, mats: list[tuple[torch.Tensor, int]], errors: list[tuple[float, float]],
           factored: list[int], exact: int) -> None:
    """Hand the step's probes and column energies ‖qⱼ‖² to the rank controller, the kept Qs' columns ordered
    strongest first (the same span: the next P and M̂ do not change; a shrink keeps the strongest); a matrix
    not factored this step (a table sent as rows) adds nothing."""
    energies = [[0.0] * r for _, r in mats]
    for i in factored:
        energy, order = st.q[idx][i].pow(2).sum(0).sort(descending=True)
        st.q[idx][i] = st.q[idx][i][:, order]
        energies[i] = energy.tolist()
    assert st.control is not None
    st.control.observe(idx, errors, energies, [tuple(m.shape) for m, _ in mats], exact)


def _offsets(parts: list[torch.Tensor]) -> list[int]:
    """Where each of `parts` starts in their concatenation."""
    out, at = [], 0
    for t in parts:
        out.append(at)
        at += t.numel()
    return out
