"""Shared pytest fixtures (a plain module of fixtures; add more as the suite grows).

The suite runs on the CPU wherever it runs: on a GPU machine its GPUs are hidden (before anything initialises
CUDA), so runs default to the CPU as in CI, and forked ranks inherit no CUDA state or autograd device threads;
unless told otherwise it runs one OpenMP thread, as `make test` does.
"""

from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # noqa: E402 - before torch is imported by anything below
# one OpenMP thread, as `make test` sets it, also for a bare `pytest`: GNU OpenMP is not fork-safe, and a test process
# whose pool had several threads leaves the ranks it forks hanging in their first parallel op (a parameter's copy_)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from hybrid.config import CONFIG_DIR, ModelConfig

CONFIGS = Path(CONFIG_DIR)
FIRST = ("e2e", "dist", "unit")  # the folders by the cost of their files: the long files start first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """End-to-end files first, then the multi-rank ones, then the unit files: `make test` hands whole files to
    its xdist workers in this order (`--no-loadscope-reorder`), so the run ends on short files, not on a
    two-minute one that started last."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.parent.name, len(FIRST)))


def load_model_config(name: str, **overrides: Any) -> ModelConfig:
    """`configs/model/<name>.yaml` typed against ModelConfig, with keyword overrides."""
    raw = OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw, overrides)
    return OmegaConf.to_object(merged)


@pytest.fixture
def model_config() -> Callable[..., ModelConfig]:
    """Factory: `model_config("gpt-tiny", n_layers=2)` → ModelConfig from the config file."""
    return load_model_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HYBRID_CACHE for the default corpus: the caller's if set (built once), else a fresh folder."""
    old = os.environ.get("HYBRID_CACHE")
    os.environ["HYBRID_CACHE"] = old or str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["HYBRID_CACHE"]
