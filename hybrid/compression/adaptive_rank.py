"""Adaptive PowerSGD rank (`compression.target_error > 0`): each matrix's rank follows its measured error.

The rank a matrix needs is a property of the gradients, not of the method: more tokens per step, another
model family or a later phase of training give the averaged gradient more directions, and a fixed rank then
leaves more of it to error feedback (2026-11-24: rank 4 lost 0.2 % of eval loss on one configuration and
6.5 % on another, where its error was 0.66).

**The measurement, free of extra collectives.** With P orthonormal and Q̄ = M̄ᵀP the all-reduced mean, the
approximation PowerSGD applies is M̂ = P·Q̄ᵀ = PPᵀM̄, M̄ the DP mean of the (error-feedback corrected)
matrices. A random probe ω, drawn from a seed every DP rank shares, goes on the matrix's shorter side:
each rank adds y = Mᵢᵀω (m ≤ n: m floats) or Mᵢω (n floats) to the all-reduce that already carries P, so
ȳ = M̄ᵀω (or M̄ω) arrives with it. Then E‖ȳ − M̂ᵀω‖² = ‖M̄ − M̂‖² and E‖ȳ‖² = ‖M̄‖², so the ratio of their
sums over a window of `compression.rank_window` steps estimates the relative error e = ‖M̄ − M̂‖/‖M̄‖.
Every input of the estimate is all-reduced or computed from all-reduced values, so every DP rank decides
alike, bit for bit, with no collective of its own. The probe costs min(n, m) floats per matrix and step
(at most 1/(2r) of the factors' bytes).

**The rule**, at the end of each window, per matrix: e > `target_error` → the rank doubles. A rank
shrinks (by a quarter, at least 1) only when the error it would have had with fewer columns stays below
`SHRINK_MARGIN` × the target: with Q̄'s columns qⱼ, ‖M̂‖² = Σ‖qⱼ‖² exactly (P orthonormal), so dropping the
weakest columns adds their energy to the error; the window sums each step's column energies, weakest last.
So a matrix of true rank k settles at k instead of swinging between k and k − 1. Growth goes to the
matrices with the largest error first and stops at the byte budget: a bucket's payload — exact elements +
Σ (n + m)·rᵢ (each factor element half an fp32 one under `compression.factor_dtype=bf16`) + the probes —
stays within its fp32 elements / `min_ratio` (the per-bucket figure that keeps the run, its exact warm-up
included, at `compression.min_ratio`: `defaults.bucket_ratio`), and no rank exceeds
`compression.max_rank`, min(n, m) or the rank at which the factors would stop being `min_compression_rate`
times smaller than the matrix. Which matrices are compressed at all is decided once, at
`compression.rank` (PyTorch's rule, as with a fixed rank), so a bucket's layout never changes; a Q kept
across steps has its columns ordered strongest first, so a shrink keeps the strongest directions.

Where the run has an exact warm-up, its last step's mean sets the first ranks instead of `compression.rank`
(`start_from`, from the mean's singular values: `start.py`).

The ranks, the window's sums and the last window's errors are per-rank hook state (`state_dict`): the
same on every DP rank, restored with the checkpoint under the same layout, and back at `compression.rank`
after a layout change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid.compression import CompressionError

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

Shape = tuple[int, int]  # (rows, cols) of a compressed matrix
SHRINK_MARGIN = 0.75  # shrink only when the error with fewer columns would stay below this × the target


def check_knobs(c: CompressionConfig) -> None:
    """The adaptive rank's knobs (one CompressionError line naming the bad one)."""
    for ok, msg in ((0 <= c.target_error < 1, f"compression.target_error must be in [0, 1) (0: a fixed rank), got "
                     f"{c.target_error}"),
                    (c.rank_window >= 1, f"compression.rank_window must be >= 1, got {c.rank_window}"),
                    (c.max_rank >= c.rank, f"compression.max_rank must be >= compression.rank={c.rank}, got "
                     f"{c.max_rank}"),
                    (c.min_ratio >= 1, f"compression.min_ratio must be >= 1 (the adaptive rank's byte budget), got "
                     f"{c.min_ratio}")):
        if not ok:
            raise CompressionError(msg)


def rank_cap(shape: Shape, max_rank: int, min_rate: float) -> int:
    """The largest rank a matrix of `shape` may take: ≤ `max_rank`, ≤ min(n, m), and its factors still
    `min_rate` times smaller than the matrix ((n + m)·r·min_rate < n·m)."""
    n, m = shape
    r = min(max_rank, n, m)
    while r > 1 and (n + m) * r * min_rate >= n * m:
        r -= 1
    return r


def probe_size(shape: Shape) -> int:
    """Floats the error probe adds to the first all-reduce for a matrix of `shape`: its shorter side."""
    return min(shape)


def payload_elements(shapes: list[Shape], ranks: list[int], exact: int, share: float = 1.0) -> float:
    """fp32 elements one bucket sends per step: `exact` elements, Σ (n + m)·r of the factors (each factor element
    `share` of an fp32 one: ½ in bf16), and the probes."""
    return exact + sum((n + m) * r * share + probe_size((n, m)) for (n, m), r in zip(shapes, ranks))


def _needed(squares: list[float], target: float, cap: int) -> int:
    """The least rank k ≤ `cap` (at least 1) whose dropped energy Σ_{j≥k} σⱼ² is within target² of the total."""
    total, k = sum(squares), 1
    while k < cap and sum(squares[k:]) > target * target * total:
        k += 1
    return k


@dataclass
class RankControl:
    """The adaptive ranks of every bucket's compressed matrices (see the module doc)."""

    start: int  # compression.rank
    target: float  # compression.target_error
    window: int  # compression.rank_window: steps per decision
    min_ratio: float  # compression.min_ratio: the byte budget
    max_rank: int  # compression.max_rank
    min_rate: float  # compression.min_compression_rate
    share: float = 1.0  # a factor element's bytes over an fp32 element's (compression.factor_dtype: bf16 ½)
    ranks: dict[int, list[int]] = field(default_factory=dict)  # bucket → rank per compressed matrix
    sums: dict[int, list[list[float]]] = field(default_factory=dict)  # bucket → [Σ‖ȳ − M̂ᵀω‖², Σ‖ȳ‖²] per matrix
    energy: dict[int, list[list[float]]] = field(default_factory=dict)  # bucket → Σ‖qⱼ‖², strongest first, per matrix
    steps: dict[int, int] = field(default_factory=dict)  # bucket → steps in its current window
    errors: dict[int, list[float]] = field(default_factory=dict)  # bucket → each matrix's error, last window

    def ranks_of(self, index: int, shapes: list[Shape]) -> list[int]:
        """The ranks of bucket `index`'s compressed matrices (`shapes`): `start` (capped) until decided."""
        if index not in self.ranks or len(self.ranks[index]) != len(shapes):
            self.ranks[index] = [min(self.start, rank_cap(s, self.max_rank, self.min_rate)) for s in shapes]
            self._restart(index)
        return self.ranks[index]

    def start_from(self, index: int, spectra: list[list[float]], shapes: list[Shape], exact: int) -> list[int]:
        """Bucket `index`'s ranks from its matrices' squared singular values (`spectra`, largest first, of an exact
        DP mean; a last entry may hold the energy beyond those found, `start.leading`): each the least whose error
        √(Σ dropped σ² / Σ σ²) meets the target, within its cap, and never below `start` (a gradient that needs few
        directions early may need more soon: the tied embedding's first gradients are nearly rank one); then,
        while over the byte budget, one column less where the last kept holds the least energy per byte, down to
        `start`. A new window."""
        caps = [rank_cap(s, self.max_rank, self.min_rate) for s in shapes]
        floors = [min(self.start, cap) for cap in caps]
        ranks = [max(f, _needed(sq, self.target, cap)) for f, sq, cap in zip(floors, spectra, caps)]
        self.ranks[index] = ranks
        while self.room(index, shapes, exact) < 0 and ranks != floors:
            above = [i for i, (r, f) in enumerate(zip(ranks, floors)) if r > f]
            ranks[min(above, key=lambda i: spectra[i][ranks[i] - 1] / sum(shapes[i]))] -= 1
        self._restart(index)
        return ranks

    def _restart(self, index: int) -> None:
        """A new window for bucket `index`: its sums at zero."""
        ranks = self.ranks[index]
        self.sums[index], self.steps[index] = [[0.0, 0.0] for _ in ranks], 0
        self.energy[index] = [[0.0] * r for r in ranks]

    def observe(self, index: int, probes: list[tuple[float, float]], energies: list[list[float]],
                shapes: list[Shape], exact: int) -> None:
        """Add one step's (‖ȳ − M̂ᵀω‖², ‖ȳ‖²) and column energies (strongest first) per matrix of bucket
        `index`; at the window's end, decide."""
        for acc, (num, den), total, step in zip(self.sums[index], probes, self.energy[index], energies):
            acc[0] += num
            acc[1] += den
            total[:] = [a + b for a, b in zip(total, step)]
        self.steps[index] += 1
        if self.steps[index] >= self.window:
            self.decide(index, shapes, exact)

    def decide(self, index: int, shapes: list[Shape], exact: int) -> None:
        """The window's errors; shrink the matrices well below the target, then grow those above it, the
        largest error first, within the bucket's byte budget."""
        errors = [(num / den) ** 0.5 if den > 0 else 0.0 for num, den in self.sums[index]]
        ranks = self.ranks[index]
        for i, ((num, den), energy) in enumerate(zip(self.sums[index], self.energy[index])):
            fewer = max(1, ranks[i] - max(1, ranks[i] // 4))
            if fewer < ranks[i] and den > 0 and (num + sum(energy[fewer:])) / den < (SHRINK_MARGIN * self.target) ** 2:
                ranks[i] = fewer
        for i in sorted(range(len(ranks)), key=lambda i: -errors[i]):
            if errors[i] > self.target:
                ranks[i] = self._grown(shapes, ranks, i, self.room(index, shapes, exact))
        self.errors[index] = errors
        self._restart(index)

    def room(self, index: int, shapes: list[Shape], exact: int) -> float:
        """Elements bucket `index` may still add to its payload at its current ranks within its byte budget,
        (exact + Σ n·m) / `min_ratio`."""
        budget = (exact + sum(n * m for n, m in shapes)) / self.min_ratio
        return budget - payload_elements(shapes, self.ranks[index], exact, self.share)

    def _grown(self, shapes: list[Shape], ranks: list[int], i: int, room: float) -> int:
        """Matrix `i`'s rank doubled, as far as its cap and `room` (the budget's elements left) allow."""
        n, m = shapes[i]
        affordable = ranks[i] + max(0, int(room // ((n + m) * self.share)))
        return max(ranks[i], min(2 * ranks[i], rank_cap(shapes[i], self.max_rank, self.min_rate), affordable))

    def figures(self, index: int) -> tuple[float, float]:
        """(mean rank, the last window's error over the bucket: √(Σe²/k)) of bucket `index`, for the record."""
        ranks, errors = self.ranks.get(index, []), self.errors.get(index, [])
        mean_rank = sum(ranks) / len(ranks) if ranks else 0.0
        return mean_rank, (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": {k: list(v) for k, v in self.ranks.items()}, "steps": dict(self.steps),
                "sums": {k: [list(s) for s in v] for k, v in self.sums.items()},
                "energy": {k: [list(e) for e in v] for k, v in self.energy.items()},
                "errors": {k: list(v) for k, v in self.errors.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.ranks = {k: list(v) for k, v in sd["ranks"].items()}
        self.sums = {k: [list(s) for s in v] for k, v in sd["sums"].items()}
        self.energy = {k: [list(e) for e in v] for k, v in sd["energy"].items()}
        self.steps, self.errors = dict(sd["steps"]), {k: list(v) for k, v in sd["errors"].items()}
