"""Models built from parallel layers: the model families (GPT-2, Llama, and any registered), their
shared blocks, and transformers conversion.

Importing this package registers the built-in families (`gpt.py`, `llama.py`); `family.py` is the
seam the rest of hybrid asks (`family_of(cfg)`), see `docs/extending.md`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from hybrid.model import gpt, llama  # noqa: F401  (each registers its family)
from hybrid.model.family import Family, ModelConfigError, family_of
from hybrid.model.layers import CausalLM
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import ModelConfig


def build_model(cfg: ModelConfig, vocab_size: int, tp_group: Group = None, layers: Optional[range] = None,
                pre: bool = True, post: bool = True, seed: int = 0, sequence_parallel: bool = False) -> CausalLM:
    """The model (or one pipeline stage of it) of `cfg.family`, initialised from `seed`."""
    return CausalLM(cfg, vocab_size, tp_group, layers, pre, post, seed, sequence_parallel)


def analytic_param_count(cfg: ModelConfig, vocab_size: int, tp: int = 1) -> int:
    """The family's closed-form parameter count of the whole model, vocabulary padded for `tp`."""
    return family_of(cfg).param_count(cfg, vocab_size, tp)


__all__ = ["CausalLM", "Family", "ModelConfigError", "analytic_param_count", "build_model", "family_of"]
