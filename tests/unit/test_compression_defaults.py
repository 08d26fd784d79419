"""Defaults that keep quality (`compression/defaults.py`): the warm-up sized from the run, the old behaviour one
setting away, the start-up line that says so, and the decision kept across a resume that extends the run."""

from __future__ import annotations

import pytest

from hybrid.compression import CompressionError, codecs
from hybrid.compression.defaults import (
    SAFE,
    WARMUP_METHODS,
    bucket_ratio,
    check_warmup,
    density_of,
    warmup_cost,
    warmup_of,
)
from hybrid.compression.hooks import make_hook
from hybrid.config import CompressionConfig, compose_config
from hybrid.sync import startup_lines
from hybrid.validation import validate

BATCH = ("train.global_batch_size=16", "train.micro_batch_size=4")


def comp(method: str, **kw: object) -> CompressionConfig:
    return CompressionConfig(method=method, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("method,steps,expected", [
    ("sign", 200, 50), ("topk", 200, 50), ("dgc", 1000, 250), ("onebit_adam", 200, 50), ("onebit_adam", 2, 1),
    ("powersgd", 200, 2), ("powersgd", 30, 1), ("torch_powersgd", 30, 2), ("int8", 200, 0), ("bf16", 200, 0),
    ("none", 200, 0), ("sign", 3, 1),
])
def test_a_null_warmup_is_sized_from_the_run(method: str, steps: int, expected: int) -> None:
    assert warmup_of(comp(method), steps) == expected


def test_the_old_behaviour_is_one_setting_away() -> None:
    assert warmup_of(comp("sign", warmup_steps=0), 200) == 0
    assert warmup_of(comp("sign", warmup_steps=7), 200) == 7
    assert warmup_of(comp("sign", warmup_share=0.1), 200) == 20
    assert warmup_of(comp("sign", schedule="auto"), 200) == 0  # the settling rule decides
    assert warmup_of(comp("hierarchical", inner="powersgd"), 500) == 5  # the inner method's
    assert warmup_of(comp("sign"), None) == 0 and warmup_of(comp("torch_powersgd"), None) == 2


def test_every_lossy_method_with_a_long_error_tail_has_a_share() -> None:
    assert {"powersgd", "sign", "topk", "dgc", "onebit_adam"} <= set(SAFE)


def test_the_hook_runs_exact_for_the_sized_warmup_and_keeps_it_on_a_resume() -> None:
    _, state = make_hook(comp("sign"), None, steps=200)
    assert state.warmup_steps == 50 and state.sized
    assert [state.stage_at(s) for s in (0, 49, 50)] == [0, 0, 1]
    saved = state.run_state()
    _, longer = make_hook(comp("sign"), None, steps=400)  # the run extended on resume: its start decided 50
    longer.load_run_state(saved)
    assert longer.warmup_steps == 50
    _, pinned = make_hook(comp("sign", warmup_steps=0), None, steps=200)
    assert pinned.run_state() is None and pinned.stage_at(0) == 1


def test_the_startup_line_says_what_and_when() -> None:
    cfg = compose_config(["compression=sign", "train.steps=200", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "exact for the first 50 steps (25% of train.steps=200" in line
    assert "compression.warmup_steps=0 compresses from step 1" in line
    assert "each gradient matrix coded divided by its factored scale" in line  # `compression.scale=auto`: sign
    cfg = compose_config(["compression=powersgd", "train.steps=100", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "exact for the first step (1% of train.steps=100" in line and "compression.target_error=0.3" in line
    cfg = compose_config(["compression=int8", *BATCH])
    assert startup_lines(cfg, validate(cfg, 4)) == ["compression: int8 over dp=4"]
    for extra, said in (([], "variance refreshed from an exact fp32 all-reduce every 10 steps"),  # β₂ = 0.95
                        (["optim.beta2=0.99"], "every 50 steps"),
                        (["compression.var_refresh_every=0"], "momentum sent as signs with the variance frozen")):
        cfg = compose_config(["compression=onebit_adam", *BATCH, *extra])
        (line,) = startup_lines(cfg, validate(cfg, 4))
        assert said in line, line


@pytest.mark.parametrize("kw,steps,expected", [
    ({}, 200, 0.99 / (1 / 20 - 0.01)),  # 2 exact steps: 24.75× per bucket keeps the run at 20×
    ({"min_ratio": 10.0}, 1000, 0.99 / (1 / 10 - 0.01)),
    ({"warmup_steps": 0}, 200, 20.0),  # no warm-up: the run's ratio is the buckets'
    ({}, None, 20.0),  # no run length: the warm-up is unknown
    ({"schedule": "auto"}, 200, 20.0),  # the settling rule decides when: unknown at the start
    ({}, 20, 20.0),  # 1 exact step of 20 = 1/20: no compressed ratio reaches 20× over the run
])
def test_powersgds_budget_is_over_the_run_warm_up_included(kw: dict, steps: int, expected: float) -> None:
    c = comp("powersgd", **kw)
    assert bucket_ratio(c, steps) == pytest.approx(expected)
    w = warmup_of(c, steps) / steps if steps and c.schedule == "fixed" else 0.0
    if 0 < w < 1 / c.min_ratio:
        assert 1 / (w + (1 - w) / bucket_ratio(c, steps)) == pytest.approx(c.min_ratio)  # the run's ratio


@pytest.mark.parametrize("method", WARMUP_METHODS)
def test_a_warm_up_codec_costs_its_encoded_bytes_and_powersgds_budget_counts_them(method: str) -> None:
    c = comp("powersgd", warmup_method=method, block_size=64)
    codec = codecs.CODECS[method].build(c) if method in codecs.CODECS else None
    n = 64 * 1000
    encoded = codec.encoded_bytes(n) if codec else {"none": 4, "bf16": 2, "fp16": 2}[method] * n
    assert warmup_cost(c) == pytest.approx(encoded / (4 * n))
    w = warmup_of(c, 200) / 200  # 2 steps of 200
    assert 1 / (w * warmup_cost(c) + (1 - w) / bucket_ratio(c, 200)) == pytest.approx(20.0)  # the run: 20×


def test_a_warm_up_codec_is_said_at_start_up_and_refused_where_the_warm_up_is_exact() -> None:
    cfg = compose_config(["compression=sign", "compression.warmup_method=int8", "train.steps=200", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "in int8 (compression.warmup_method) for the first 50 steps (25% of train.steps=200" in line, line
    for bad, says in ((comp("sign", warmup_method="sign"), "must be one of none, bf16, fp16, int8, int4"),
                      (comp("sign", warmup_method="int8", schedule="auto"), "applies to schedule=fixed"),
                      (comp("zeroone_adam", warmup_method="int8"), "not apply to compression=zeroone_adam")):
        with pytest.raises(CompressionError, match=says):
            check_warmup(bad)


def test_the_startup_line_says_the_budget_per_bucket_and_over_the_run() -> None:
    cfg = compose_config(["compression=powersgd", "train.steps=200", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "within 24.8× fewer bytes per bucket, so that the run sends compression.min_ratio=20× fewer" in line
    cfg = compose_config(["compression=powersgd", "train.steps=20", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "the warm-up alone (5% of the run exact) keeps the run under 20×" in line


@pytest.mark.parametrize("overrides,says", [
    ([], "factors sent in bf16 (half the bytes: twice the rank in the same budget; compression.factor_dtype=fp32"),
    (["compression.factor_dtype=fp32"], "factors sent in fp32"),
])
def test_the_startup_line_says_what_the_factors_travel_in(overrides: list[str], says: str) -> None:
    cfg = compose_config(["compression=powersgd", "train.steps=200", *BATCH, *overrides])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert says in line, line


@pytest.mark.parametrize("overrides,says", [
    (["model=llama-tiny"], "exactly, where they cost no more than its factors (compression.lookup_rows)"),
    (["model=llama-tiny", "compression.lookup_rows=false"], "(compression.lookup_rows=false: factors instead)"),
    (["model=gpt-tiny"], None),  # the token embedding is the head's: its gradient is dense
    (["model=llama-tiny", "sync=diloco"], None),  # pseudo-gradients: every row moves
])
def test_the_startup_line_says_where_the_token_embedding_goes_as_rows(overrides: list[str], says: str) -> None:
    cfg = compose_config(["compression=powersgd", "train.steps=200", *BATCH, *overrides])
    (line,) = [s for s in startup_lines(cfg, validate(cfg, 4)) if s.startswith("compression:")]
    assert (says in line) if says else ("lookup_rows" not in line), line


@pytest.mark.parametrize("kw,steps,expected", [
    ({}, 200, 10 / 150),  # 50 exact steps, 150 compressed: each coordinate about 10 times
    ({}, 5000, 0.01),  # 3,750 compressed steps: the floor
    ({"method": "dgc", "warmup_steps": 0}, 400, 10 / 400),
    ({"schedule": "auto"}, 500, 10 / 500),  # the switch is unknown at the start: the whole run
    ({}, None, 0.01),
    ({"fraction": 0.01}, 200, 0.01),  # pinned: the old behaviour
    ({"warmup_steps": 0}, 5, 1.0),  # a run shorter than SENDS steps sends everything
])
def test_topk_density_is_sized_from_the_compressed_steps(kw: dict, steps: int, expected: float) -> None:
    knobs = {k: v for k, v in kw.items() if k != "method"}
    assert density_of(comp(str(kw.get("method", "topk")), **knobs), steps) == pytest.approx(expected)


def test_the_hook_sends_the_sized_density_and_the_startup_line_says_it() -> None:
    _, state = make_hook(comp("topk"), None, steps=200)
    assert state.state.codec.fraction == pytest.approx(10 / 150)
    cfg = compose_config(["compression=dgc", "train.steps=200", *BATCH])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert "6.67% of each chunk sent (sized from the run" in line and "compression.fraction=0.01 pins it" in line


@pytest.mark.parametrize("overrides,says", [
    ([], "ranks to start from the exact warm-up's last gradients (each matrix the least meeting the target, at "
         "least 4, within the budget)"),
    (["compression.warmup_method=int8"], "ranks to start from the int8 warm-up's last gradients"),
    (["compression.warmup_steps=0"], "rank 4 to start"),  # no exact step to start from
    (["compression.schedule=auto"], "rank 4 to start"),  # the last exact step is not known in advance
])
def test_the_startup_line_says_where_powersgds_ranks_start(overrides: list[str], says: str) -> None:
    cfg = compose_config(["compression=powersgd", "train.steps=200", *BATCH, *overrides])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert says in line, line
