"""The adaptive PowerSGD rank's rule (`compression/adaptive_rank.py`) on made-up window sums: grow above the target,
shrink only when fewer columns would still meet it, the budget and the caps, the largest error first, state."""

from __future__ import annotations

import pytest

from hybrid.compression.adaptive_rank import RankControl, payload_elements, rank_cap

SHAPES = [(256, 64), (64, 64)]


def control(**kw: float) -> RankControl:
    args = {"start": 4, "target": 0.3, "window": 2, "min_ratio": 4.0, "max_rank": 32, "min_rate": 2.0, **kw}
    return RankControl(**args)  # type: ignore[arg-type]


def window(c: RankControl, errors: list[float], energies: list[list[float]], shapes: list = SHAPES,
           exact: int = 0) -> list[int]:
    """Feed one window of steps whose probes say `errors` (relative, ‖M̄‖² = 1) and column `energies`."""
    ranks = list(c.ranks_of(0, shapes))
    for _ in range(c.window):
        c.observe(0, [(e * e, 1.0) for e in errors], energies, shapes, exact)
    return ranks


def test_rank_cap_keeps_the_factors_smaller_than_the_matrix() -> None:
    assert rank_cap((64, 64), 32, 2.0) == 15  # (64 + 64)·15·2 < 4096 ≤ (64 + 64)·16·2
    assert rank_cap((256, 64), 8, 2.0) == 8
    assert rank_cap((3, 100), 32, 1.0) == 2  # (103)·3 ≥ 300


def test_a_rank_doubles_while_the_error_is_above_the_target() -> None:
    c = control(min_ratio=1.0)
    assert window(c, [0.9, 0.9], [[0.01] * 4, [0.01] * 4]) == [4, 4]
    assert c.ranks[0] == [8, 8]
    window(c, [0.9, 0.9], [[0.01] * 8, [0.01] * 8])
    assert c.ranks[0] == [16, 15]  # the 64 × 64 matrix stops at its cap
    assert c.errors[0] == pytest.approx([0.9, 0.9])


def test_growth_stops_at_the_byte_budget_largest_error_first() -> None:
    c = control(min_ratio=8.0)  # budget: (256·64 + 64·64) / 8 = 2560 elements; 1920 at rank 4
    window(c, [0.5, 0.8], [[0.01] * 4, [0.01] * 4])
    ranks = c.ranks[0]
    assert payload_elements(SHAPES, ranks, 0) <= (256 * 64 + 64 * 64) / 8
    assert ranks == [4, 8]  # the 64 × 64 one (error 0.8) took the room first; 128 elements left, < 320 a rank


def test_a_rank_shrinks_only_when_fewer_columns_still_meet_the_target() -> None:
    c = control(min_ratio=1.0)
    window(c, [0.01, 0.01], [[0.5, 0.3, 1e-6, 1e-6], [0.4, 0.3, 0.2, 0.1]])
    assert c.ranks[0] == [3, 4]  # the first's weakest column is empty; dropping the second's costs 0.2 of 1
    window(c, [0.01, 0.01], [[0.5, 0.3, 1e-6], [0.4, 0.3, 0.2, 0.1]])
    assert c.ranks[0] == [2, 4]
    window(c, [0.01, 0.01], [[0.5, 0.3], [0.4, 0.3, 0.2, 0.1]])
    assert c.ranks[0] == [2, 4]  # true rank 2: dropping a column would leave an error of √0.3


def test_an_error_between_the_bounds_keeps_the_rank() -> None:
    c = control(min_ratio=1.0)
    window(c, [0.25, 0.25], [[0.3] * 4, [0.3] * 4])
    assert c.ranks[0] == [4, 4]


def test_the_start_rank_is_capped_by_the_shape() -> None:
    c = control(start=4, max_rank=4)
    assert c.ranks_of(1, [(6, 3)]) == [1]  # (6 + 3)·2·2 ≥ 18: only rank 1 keeps the factors 2× smaller


def test_state_round_trips_mid_window() -> None:
    c = control(min_ratio=1.0, window=3)
    window(c, [0.9, 0.1], [[0.1] * 4, [0.1] * 4])  # three observations: one decision
    c.observe(0, [(0.81, 1.0), (0.01, 1.0)], [[0.1] * 8, [0.1] * 4], SHAPES, 0)
    d = control(min_ratio=1.0, window=3)
    d.load_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict()
    for x in (c, d):
        for _ in range(2):
            x.observe(0, [(0.81, 1.0), (0.01, 1.0)], [[0.1] * 8, [0.1] * 4], SHAPES, 0)
    assert d.ranks == c.ranks and d.errors == c.errors


def test_the_start_from_a_spectrum_is_the_least_rank_meeting_the_target() -> None:
    c = control(min_ratio=1.0, start=1)
    flat = [1.0] * 64  # error at rank k: √((64 − k)/64) ≤ 0.3 from k = 59, capped at 15
    decaying = [0.5, 0.3, 0.15, 0.04, 0.01] + [0.0] * 59  # rank 3 leaves 0.05 of 1: error 0.22 ≤ 0.3
    assert c.start_from(0, [decaying, flat], SHAPES, 0) == [3, 15]
    assert c.ranks_of(0, SHAPES) == [3, 15]  # kept: no window has run
    c = control(min_ratio=1.0)
    assert c.start_from(0, [decaying, flat], SHAPES, 0) == [4, 15]  # never below `start`
    assert c.steps[0] == 0 and c.sums[0] == [[0.0, 0.0], [0.0, 0.0]]


def test_the_start_is_trimmed_to_the_budget_where_a_column_holds_least_per_byte() -> None:
    c = control(min_ratio=8.0)  # budget 2560 elements: (256 + 64)·r₁ + (64 + 64)·r₂ with probes 64 + 64
    strong = [0.1] * 10 + [0.0] * 54  # needs 10 columns, each 0.1 of the energy
    weak = [0.02] * 50 + [0.0] * 14  # needs 15 (its cap), each column 0.02
    ranks = c.start_from(0, [strong, weak], SHAPES, 0)
    assert payload_elements(SHAPES, ranks, 0) <= (256 * 64 + 64 * 64) / 8
    assert ranks == [6, 4]  # a weak column holds 0.02/128 an element, a strong one 0.1/320: the weak went first,
    assert c.room(0, SHAPES, 0) >= 0  # down to `start`
    for more in ([7, 4], [6, 5]):  # one more column of either would not fit
        assert payload_elements(SHAPES, more, 0) > (256 * 64 + 64 * 64) / 8
    c = control(min_ratio=100.0)  # not even `start` fits: the start is `start`, as a cold one
    assert c.start_from(0, [strong, weak], SHAPES, 0) == [4, 4]
