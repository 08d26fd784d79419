"""The pure helpers of `hybrid.bench.memory_at_scale`: run specs, the global batch, the launch rule and the
largest-model search (no ranks are launched; the 8-rank measurements are the benchmark's own)."""

from __future__ import annotations

import pytest

from hybrid.bench import memory_at_scale as mas

GIB = 2**30


@pytest.mark.parametrize("text,want", [
    ("gpt-350m tp2pp4 none", mas.Spec("gpt-350m", 2, 4, "none", 0, None)),
    ("gpt-350m pp2dp4 full zero", mas.Spec("gpt-350m", 1, 2, "full", 1, None)),
    ("gpt-350m tp1pp2 selective zero1 layers=8", mas.Spec("gpt-350m", 1, 2, "selective", 1, 8)),
    ("gpt-1b tp2pp4dp1 full zero0 layers=12", mas.Spec("gpt-1b", 2, 4, "full", 0, 12)),
    ("gpt-350m pp2dp4 none zero2", mas.Spec("gpt-350m", 1, 2, "none", 2, None)),
    ("gpt-tiny dp8 none", mas.Spec("gpt-tiny", 1, 1, "none", 0, None)),
])
def test_a_spec_names_its_layout_and_features(text: str, want: mas.Spec) -> None:
    spec = mas.parse_spec(text)
    assert spec == want and spec.dp * spec.tp * spec.pp == 8
    assert mas.parse_spec(str(spec)) == spec  # the printed form reads back


@pytest.mark.parametrize("text", ["gpt-1b tp2pp4", "gpt-1b tp3pp2 none", "gpt-1b pp2dp2 none",
                                  "gpt-1b tp2pp4 fast", "gpt-1b tp2pp4 none zero5", "gpt-1b tp2pp4 none zero4",
                                  "gpt-1b x4 none"])
def test_a_bad_spec_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="run"):
        mas.parse_spec(text)


def test_the_global_batch_gives_each_dp_rank_pp_microbatches_unless_set() -> None:
    args = mas.parse_args(["--micro-batch", "2"])
    assert mas.global_batch(mas.parse_spec("m tp2pp4 none"), args) == 2 * 1 * 4
    assert mas.global_batch(mas.parse_spec("m pp2dp4 none"), args) == 2 * 4 * 2
    assert mas.global_batch(mas.parse_spec("m pp2dp4 none"), mas.parse_args(["--global-batch", "64"])) == 64
    words = mas.overrides("gpt-1b pp2dp4 full zero layers=3", args)
    assert {"parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.zero=1", "train.recompute=full",
            "train.global_batch_size=16", "model.n_layers=3", "train.precision=fp32"} <= set(words)


def test_the_launch_rule_charges_the_process_per_rank_and_keeps_the_budget_and_a_reserve() -> None:
    assert mas.need_bytes(10 * GIB, 0.4) == 10 * GIB + int(3.2 * GIB)
    assert mas.refusal(int(15.9 * GIB), 16, 30 * GIB) is None
    assert "16 GiB rule" in mas.refusal(int(16.1 * GIB), 16, 30 * GIB)
    assert "MemAvailable" in mas.refusal(12 * GIB, 16, 13 * GIB)  # 2 GiB must stay free
    assert mas.refusal(11 * GIB, 16, 13 * GIB) is None


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 50, 95, 96, 200])
def test_most_layers_by_bisection_equals_a_linear_scan(limit: int) -> None:
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= limit

    linear = max((n for n in range(2, 97) if n <= limit), default=None)
    assert mas.most_layers(fits, 2, 96) == linear
    assert len(calls) <= 9  # log2(95) + the start
