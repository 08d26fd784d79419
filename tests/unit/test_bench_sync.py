"""`hybrid.bench.sync_modes` and `hybrid.bench.sync_slow_links` end to end in `--quick` mode (no timing
assertions: the figures exist, and the exact ones — inter-node bytes — agree with their formulas)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hybrid.bench import sync_modes, sync_slow_links


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HYBRID_CACHE for the default corpus: the caller's if set (built once), else a fresh folder."""
    old = os.environ.get("HYBRID_CACHE")
    os.environ["HYBRID_CACHE"] = old or str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["HYBRID_CACHE"]


@pytest.mark.timeout(600)
def test_sync_modes_quick_bytes_follow_the_modes(cache: None) -> None:
    """4 steps at H=2: DiLoCo exchanges the whole model twice between nodes; hierarchical sync DP exchanges
    half the model (each rank's half after the node's reduce-scatter) every step — the same total; gossip's
    ring sends the whole model to its one neighbour on the other node in each of 3 rounds, then hands it to
    the final average over both nodes; the parameter server on node 0 gets a gradient from and sends the model
    to each of node 1's two workers every step (the 4 ranks' mean: one model each way per rank)."""
    lines: list[str] = []
    rows = {r["label"]: r for r in sync_modes.run(sync_modes.parse_args(["--quick"]), lines.append)}
    assert set(rows) == {"sync DP", "DiLoCo H=2 none", "local SGD H=2", "gossip ring", "PS sync", "PS async k=2"}
    model = rows["DiLoCo H=2 none"]["inter"] / 2  # one fp32 model per outer step
    assert rows["sync DP"]["inter"] == pytest.approx(4 * model / 2)
    assert rows["local SGD H=2"]["inter"] == rows["DiLoCo H=2 none"]["inter"]
    assert rows["gossip ring"]["inter"] == pytest.approx(3 * model + model)
    for ps in ("PS sync", "PS async k=2"):  # node 1's two workers push a gradient and pull the model each step
        assert rows[ps]["inter"] == pytest.approx(4 * 2 * model * 2 / 4)
    assert all(r["eval"] > 0 for r in rows.values())
    assert any(line.startswith("| DiLoCo H=2 none") for line in lines)


@pytest.mark.timeout(600)
def test_slow_links_quick_times_every_mode_under_every_condition(cache: None) -> None:
    lines: list[str] = []
    times = sync_slow_links.run(sync_slow_links.parse_args(["--quick"]), lines.append)
    assert set(times) == set(sync_slow_links.CONDITIONS)
    assert all(len(blocks) == 2 and min(blocks) > 0 for per_mode in times.values() for blocks in per_mode)
    assert sum(line.startswith("| slow link") for line in lines) == len(sync_slow_links.modes(2))
