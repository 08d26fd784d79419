"""What a resume compares with the saved run: model shape (an error), layout and other config (logged)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybrid.checkpoint import FORMAT, CheckpointError, check_compatible, config_changes, model_shape
from hybrid.config import compose_config


def _manifest(overrides: list[str], vocab: int = 300) -> dict:
    cfg = compose_config(overrides)
    return {"format": FORMAT, "model_shape": model_shape(cfg.model, vocab),
            "config": OmegaConf.to_container(cfg, resolve=True)}


def test_config_changes_lists_changed_keys_but_not_layout_checkpoint_or_logging() -> None:
    saved = _manifest(["train.steps=10", "parallel=tp2"])["config"]
    now = compose_config(["train.steps=20", "train.lr=1e-3", "parallel=tp4pp2", "checkpoint.every=5",
                          "logging.log_every=3"])
    assert config_changes(saved, now) == ["train.lr: 0.003 → 0.001", "train.steps: 10 → 20"]
    assert config_changes(saved, compose_config(["train.steps=10", "parallel=single"])) == []


@pytest.mark.parametrize("override, field", [("model.hidden=128", "hidden"), ("model.n_layers=2", "n_layers"),
                                             ("model.n_kv_heads=2", "n_kv_heads"), ("model=llama-tiny", "family"),
                                             ("model.tie_embeddings=false", "tie_embeddings")])
def test_another_model_shape_is_an_error_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(CheckpointError, match=rf"another model shape \(.*{field}="):
        check_compatible(_manifest([]), compose_config([override]), 300, Path("ck/step_0000001"))


def test_layout_and_vocab_padding_may_change_but_the_vocabulary_may_not() -> None:
    check_compatible(_manifest(["parallel=tp2"]), compose_config(["parallel=tp4pp2",
                                                                  "model.make_vocab_size_divisible_by=64"]),
                     300, Path("x"))
    with pytest.raises(CheckpointError, match="vocab_size=300 there, 301 here"):
        check_compatible(_manifest([]), compose_config([]), 301, Path("x"))
