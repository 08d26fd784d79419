"""Models built from parallel layers: GPT-2 and Llama families, and transformers conversion."""

from __future__ import annotations

from typing import Any, Optional

from hybrid.model.gpt import gpt_param_count
from hybrid.model.layers import CausalLM
from hybrid.model.llama import llama_param_count
from hybrid.parallel.collectives import Group


def build_model(cfg: Any, vocab_size: int, tp_group: Group = None, layers: Optional[range] = None,
                pre: bool = True, post: bool = True, seed: int = 0, sequence_parallel: bool = False) -> CausalLM:
    """The model (or one pipeline stage of it) of `cfg.family`, initialised from `seed`."""
    return CausalLM(cfg, vocab_size, tp_group, layers, pre, post, seed, sequence_parallel)


def analytic_param_count(cfg: Any, vocab_size: int, tp: int = 1) -> int:
    """The family's closed-form parameter count of the whole model, vocabulary padded for `tp`."""
    return (gpt_param_count if cfg.family == "gpt" else llama_param_count)(cfg, vocab_size, tp)


__all__ = ["CausalLM", "analytic_param_count", "build_model"]
