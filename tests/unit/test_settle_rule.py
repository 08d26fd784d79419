"""The auto schedule's settling rule against a reference written here from its documented definition, on
noisy decaying loss curves; its state across a save/load mid-window; the parameters kept exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
from torch import nn

from hybrid.compression.schedule import Plateau, StageSchedule, exact_kinds, exact_param_ids


def reference_bounds(losses: list[float], window: int, tol: float, min_steps: int, stages: int) -> list[int]:
    """The documented rule, step by step: a stage ends after step t when it has run ≥ min_steps steps, holds
    ≥ 2·window of its own losses, and (mean of the window before − mean of the last) / mean before < tol."""
    bounds: list[int] = []
    start = 0
    for t in range(1, len(losses) + 1):
        if len(bounds) == stages - 1:
            break
        own = losses[start:t]
        if t - start < min_steps or len(own) < 2 * window:
            continue
        before = float(np.mean(own[-2 * window:-window]))
        last = float(np.mean(own[-window:]))
        if (before - last) / abs(before) < tol:
            bounds.append(t)
            start = t
    return bounds


def curve(seed: int, steps: int = 300) -> list[float]:
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    return list(3.0 + 7.0 * np.exp(-t / rng.uniform(10, 80)) + rng.normal(0, rng.uniform(0.01, 0.3), steps))


def run(schedule: StageSchedule, losses: list[float]) -> list[int]:
    for step, loss in enumerate(losses, start=1):
        schedule.observe(step, loss)
    return schedule.bounds


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("window", "tol", "min_steps", "stages"),
                         [(10, 0.02, 0, 2), (5, 0.01, 30, 2), (8, 0.03, 0, 4), (1, 0.05, 3, 3)])
def test_switches_where_the_reference_rule_does(seed: int, window: int, tol: float, min_steps: int,
                                                stages: int) -> None:
    losses = curve(seed)
    names = ["none", *["int8"] * (stages - 2), "sign"]
    got = run(StageSchedule(names, rule=Plateau(window, tol), min_steps=min_steps), losses)
    assert got == reference_bounds(losses, window, tol, min_steps, stages)


def test_a_fixed_schedule_never_moves_and_stages_follow_the_bounds() -> None:
    fixed = StageSchedule(["none", "sign"], bounds=[7])
    assert run(fixed, curve(0, 50)) == [7]
    assert [fixed.stage(s) for s in (0, 6, 7, 40)] == [0, 0, 1, 1]
    assert [fixed.method(s) for s in (6, 7)] == ["none", "sign"]


def test_a_non_finite_loss_never_settles() -> None:
    losses = [5.0] * 4 + [math.nan] * 40
    assert run(StageSchedule(["none", "sign"], rule=Plateau(3, 0.5)), losses) == []


@pytest.mark.parametrize("cut", [3, 17, 25, 61, 140])
def test_a_resumed_schedule_decides_as_the_uninterrupted_one(cut: int) -> None:
    losses = curve(3)
    make = lambda: StageSchedule(["none", "bf16", "int8", "sign"], rule=Plateau(6, 0.02))  # noqa: E731
    whole = run(make(), losses)
    first = make()
    for step, loss in enumerate(losses[:cut], start=1):
        first.observe(step, loss)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for step, loss in enumerate(losses[cut:], start=cut + 1):
        resumed.observe(step, loss)
    assert resumed.bounds == whole


def test_another_stage_list_keeps_only_the_bounds_whose_stages_agree() -> None:
    saved = {"names": ["none", "bf16", "sign"], "bounds": [12, 30], "losses": []}
    same_start = StageSchedule(["none", "bf16", "int8", "sign"], rule=Plateau(5, 0.02))
    same_start.load_state_dict(saved)
    assert same_start.bounds == [12]
    other = StageSchedule(["none", "int8", "sign"], rule=Plateau(5, 0.02))
    other.load_state_dict(saved)
    assert other.bounds == []


def test_kept_exact_kinds() -> None:
    model = nn.ModuleDict({"tok_embed": nn.Embedding(10, 4), "norm": nn.LayerNorm(4), "proj": nn.Linear(4, 4)})
    named = list(model.named_parameters())
    vectors = {n for n, p in named if p.ndim < 2}
    assert {n for n, p in named if id(p) in exact_param_ids(named, ["vectors"])} == vectors
    both = {n for n, p in named if id(p) in exact_param_ids(named, ["vectors", "embeddings"])}
    assert both == vectors | {"tok_embed.weight"}
    assert exact_kinds(None, "auto") == ["vectors"] and exact_kinds(None, "fixed") == []
    assert exact_kinds(["embeddings"], "auto") == ["embeddings"]


def test_kept_exact_name_patterns_on_every_chunk() -> None:
    """Patterns match the model's own names, chunk by chunk (`kept_exact`): `layers.3...` on the stage holding it."""
    from hybrid.config import compose_config
    from hybrid.sync.dp import kept_exact

    stage = nn.ModuleDict({"layers": nn.ModuleDict({"3": nn.ModuleDict({"mlp": nn.Linear(4, 4)})}),
                           "head": nn.Linear(4, 8, bias=False)})
    chunks = nn.ModuleList([stage])
    cfg = compose_config(["compression=sign", "compression.exact_params=[head.*,'*.mlp.weight']"])
    ids = kept_exact(cfg, chunks)
    assert ids == {id(stage["head"].weight), id(stage["layers"]["3"]["mlp"].weight)}
    named = list(stage.named_parameters())
    assert exact_param_ids(named, ["vectors", "layers.?.mlp.*"]) == {id(p) for n, p in named if "mlp" in n}
