"""`parallel.stage_layers=auto`: the split against every split of a few layers (brute force), the costs it is made
of, the config's resolution and its bad input, and the simulator's per-part costs it is judged by."""

from __future__ import annotations

import itertools

import pytest

from hybrid.config import ConfigError, compose_config
from hybrid.parallel.pp.actions import ScheduleError
from hybrid.parallel.pp.pipeline import partition_layers
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.parallel.pp.simulator import simulate
from hybrid.plan.balance import auto_stage_layers, balance, part_passes, resolve, seconds
from hybrid.validation import validate


def splits(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every split of n layers into parts: middle parts at least one layer, the first and last may be empty."""
    out = []
    for counts in itertools.product(range(n + 1), repeat=parts):
        if sum(counts) == n and all(c >= 1 for c in counts[1:-1]):
            out.append(counts)
    return out


def worst(counts: list[int] | tuple[int, ...], layer: float, first: float, last: float) -> float:
    loads = [c * layer for c in counts]
    loads[0] += first
    loads[-1] += last
    return max(loads)


@pytest.mark.parametrize("first,last", [(0.0, 0.0), (0.3, 5.3), (2.5, 0.0), (1.0, 1.0), (0.1, 12.0)])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_balance_reaches_the_least_costliest_part_of_every_split(parts: int, first: float, last: float) -> None:
    for n in range(max(parts - 2, 1), 10):
        counts = balance(n, parts, 1.0, first, last)
        assert len(counts) == parts and sum(counts) == n and all(c >= 1 for c in counts[1:-1]), counts
        best = min(worst(s, 1.0, first, last) for s in splits(n, parts))
        assert worst(counts, 1.0, first, last) == pytest.approx(best), (n, counts)


def test_balance_without_extras_is_the_equal_split() -> None:
    assert balance(12, 4, 1.0, 0.0, 0.0) == [3, 3, 3, 3]
    assert sorted(balance(10, 4, 2.0, 0.0, 0.0)) == [2, 2, 3, 3]
    assert balance(7, 1, 1.0, 5.0, 5.0) == [7]


def test_a_heavy_head_takes_layers_off_the_last_part() -> None:
    assert balance(12, 4, 1.0, 0.0, 5.3) == [4, 4, 4, 0]
    assert balance(12, 2, 1.0, 0.0, 4.0) == [8, 4]


def config(*extra: str):  # noqa: ANN201 - a composed Config
    return compose_config(["model=gpt-125m", "parallel=pp4", "data.seq_len=256", "train.micro_batch_size=1",
                           *extra])


def test_the_head_of_a_gpt2_vocabulary_costs_layers_and_the_embedding_little() -> None:
    """gpt-125m's head (768 × 50304) is ~5 layers of FLOPs (2·h·V against ~24·h² + attention per token)."""
    layer, embed, head = (seconds(x) for x in part_passes(config(), 50304, "cpu"))
    assert 3.5 < head / layer < 7.0 and embed / layer < 0.2
    counts = auto_stage_layers(config(), 50304, "cpu")
    assert sum(counts) == 12 and counts[-1] < counts[0]
    assert auto_stage_layers(config(), 64, "cpu") == [3, 3, 3, 3]  # a tiny vocabulary: the equal split


def test_resolve_replaces_auto_by_the_split_and_says_so() -> None:
    cfg = config("parallel.stage_layers=auto")
    validate(cfg, 4, 4)
    line = resolve(cfg, 50304, "cpu")
    assert list(cfg.parallel.stage_layers) == auto_stage_layers(config(), 50304, "cpu")
    assert "stage balance (parallel.stage_layers=auto): layers per part [" in line and "the head and loss" in line
    plain = config("parallel.stage_layers=[3,3,3,3]")
    assert resolve(plain, 50304, "cpu") == "" and list(plain.parallel.stage_layers) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="must be resolved into layer counts before the model is built"):
        partition_layers(12, 4, "auto")  # a path that builds a model without resolving says so


@pytest.mark.parametrize("value", ["balanced", "[1.5,2.5]", "3"])
def test_stage_layers_neither_auto_nor_counts_is_refused(value: str) -> None:
    cfg = compose_config(["parallel=pp2", f"parallel.stage_layers={value}"])
    with pytest.raises(ConfigError, match="parallel.stage_layers must be auto or a list of layer counts"):
        validate(cfg, 2, 2)


def test_simulator_part_costs() -> None:
    """Equal parts replay as the uniform costs; a costlier last part lengthens the step; the zero-bubble split of
    each part's backward keeps its share."""
    s = build_schedule("1f1b", 4, 8, 1)
    assert simulate(s, parts=[(1.0, 2.0)] * 4).makespan == simulate(s, 1.0, 2.0).makespan
    assert simulate(s, parts=[(1.0, 2.0)] * 3 + [(2.0, 4.0)]).makespan > simulate(s, 1.0, 2.0).makespan
    v = build_schedule("interleaved", 2, 4, 2)
    assert simulate(v, parts=[(0.5, 1.0)] * 4).makespan == simulate(v, 1.0, 2.0).makespan
    zb = build_schedule("zb1p", 2, 4, 1)
    assert simulate(zb, parts=[(1.0, 2.0)] * 2, weight=0.5).makespan == simulate(zb, 1.0, 2.0, weight=0.5).makespan
    with pytest.raises(ScheduleError, match="3 part costs for 4 model parts"):
        simulate(s, parts=[(1.0, 2.0)] * 3)


def test_the_bench_runs_both_splits_and_predicts_them(capsys: pytest.CaptureFixture[str]) -> None:
    """`stage_balance --quick`: both splits launched on 2 ranks and timed, each predicted (no claim on the times)."""
    from hybrid.bench import stage_balance

    got = stage_balance.run(stage_balance.parse_args(["--quick"]))
    assert set(got["counts"]) == {"equal", "auto"} and all(sum(c) == 4 for c in got["counts"].values())
    assert got["ratio"] > 0 and got["predicted"] > 0 and all(len(r) == 1 for r in got["got"]["auto"])
    assert "auto / equal step time: measured" in capsys.readouterr().out
