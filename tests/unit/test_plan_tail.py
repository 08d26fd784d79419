"""The planner's DP exchange tail (`plan.tail`) against hand-counted queues and against the DP sync's own bucket
layout (`parallel.dp.buckets.assign_buckets`) for real models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybrid.config import compose_config
from hybrid.model import build_model
from hybrid.parallel.dp.buckets import assign_buckets
from hybrid.plan import tail
from hybrid.plan.cost import shape_of
from hybrid.plan.hardware import Link, preset
from hybrid.plan.predict import Candidate, predict, stage_elements, stage_segments
from hybrid.plan.tail import Segment


def four_layers(embedding: float = 0.0) -> list[Segment]:
    return tail.segments(1.0, 4, embedding, 0.0)


def test_a_bucket_a_layer_leaves_the_last_one_exposed_on_a_link_that_keeps_up() -> None:
    # buckets launch at 1, 2, 3, 4 s of a 4 s backward, each 1 s on the link: the last ends at 5 s
    assert tail.exposed(four_layers(), 4.0, 4.0, 1.0, per_unit=False) == pytest.approx(1.0)


def test_a_slow_link_queues_the_buckets_and_the_embedding_ends_the_queue() -> None:
    # 2 s a bucket: ends at 3, 5, 7, 9 s
    assert tail.exposed(four_layers(), 8.0, 4.0, 1.0, per_unit=False) == pytest.approx(5.0)
    # a tied embedding of two more elements, final at the end: 6 buckets, 1 s each, the last three queued at 4 s
    assert tail.exposed(four_layers(2.0), 6.0, 4.0, 1.0, per_unit=False) == pytest.approx(3.0)
    # final at once (an untied head's, read first), they go first: the link is busy from 0 s, only the 2 s it
    # carries beyond the backward's 4 s are exposed
    early = tail.segments(1.0, 4, 0.0, 2.0)
    assert tail.exposed(early, 6.0, 4.0, 1.0, per_unit=False) == pytest.approx(2.0)


def test_buckets_cross_layers_but_not_zero_units() -> None:
    parts = tail.segments(1.5, 2, 0.0, 0.0)
    assert tail._buckets(parts, 1.0, per_unit=False) == [(1.0, 0.5), (1.0, 1.0), (1.0, 1.0)]
    assert tail._buckets(parts, 1.0, per_unit=True) == [(1.0, 0.5), (0.5, 0.5), (1.0, 1.0), (0.5, 1.0)]


def test_an_untied_head_on_one_stage_is_counted_and_final_first() -> None:
    cfg = compose_config(["model=llama-tiny", "model.n_layers=4"])
    shape = shape_of(cfg.model, 512)
    assert not shape.tied
    one, two = Candidate(1, 1, 2, zero=0), Candidate(1, 2, 1, zero=0)
    head = shape.vocab * shape.hidden
    assert stage_elements(shape, one) == pytest.approx(4 * shape.layer_params() + 2 * head)
    assert stage_elements(shape, two) == pytest.approx(2 * shape.layer_params() + head)
    assert stage_segments(shape, one)[0] == Segment(head, 0.0)


@pytest.mark.parametrize("family", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("layers", [2, 8])
@pytest.mark.parametrize("layers_a_bucket", [1.0, 3.0])
def test_what_launches_as_the_backward_ends_matches_the_dp_syncs_buckets(family: str, layers: int,
                                                                          layers_a_bucket: float) -> None:
    """The elements in buckets holding the first layer's or the embeddings' gradients (final only as the backward
    ends), by the model and by `assign_buckets` on the real model: within 1.6× (the sync's buckets never split a
    parameter, so their edges move; the model leaves out norms, biases and learned positions)."""
    cfg = compose_config([f"model={family}", f"model.n_layers={layers}"])
    named = list(build_model(cfg.model, 512).named_parameters())
    shape = shape_of(cfg.model, 512)
    bucket = int(shape.layer_params() * layers_a_bucket)
    last = {id(p) for n, p in named if n.startswith("layers.0.") or "embed" in n}
    real = sum(sum(p.numel() for p in b) for b in assign_buckets([p for _, p in named], 4 * bucket)
               if any(id(p) in last for p in b))
    model = sum(n for n, at in tail._buckets(stage_segments(shape, Candidate(1, 1, 2, zero=0)), bucket, False)
                if at == 1.0)
    assert 1 / 1.7 <= model / real <= 1.7


def test_a_slow_link_exposes_the_queue_and_a_fast_one_only_the_last_buckets() -> None:
    shape = shape_of(compose_config(["model=gpt-1b"]).model, 50304)
    c = Candidate(1, 1, 16, micro=8, zero=0)
    h100 = preset("dgx-h100", 2)
    fast = predict(shape, c, replace(h100, inter=h100.intra), 128, 2048).parts
    slow = predict(shape, c, replace(h100, inter=Link(1e9, 1e-5)), 128, 2048).parts
    assert fast["dp_total"] < 0.5 * fast["compute"] and fast["dp_exposed"] < 0.5 * fast["dp_total"]
    assert slow["dp_exposed"] > slow["dp_total"] - 0.9 * slow["compute"]
