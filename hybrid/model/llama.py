"""Llama family: RMSNorm, SwiGLU, rotary positions (rotate-half layout), GQA, no biases.

The blocks live in `layers.py`; this module names the family's analytic parameter count.
"""

from __future__ import annotations

from typing import Any

from hybrid.parallel.tensor import padded_vocab


def llama_param_count(cfg: Any, vocab_size: int, tp: int = 1) -> int:
    """Parameters: V'h (+ V'h untied head) + L(h(h + 2·kv·d) + h² + 3·h·ffn + 2h) + h."""
    h, L, v = cfg.hidden, cfg.n_layers, padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    kv = (cfg.n_kv_heads or cfg.n_heads) * (h // cfg.n_heads)
    ffn = cfg.ffn_hidden or 4 * h
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    head = 0 if cfg.tie_embeddings else v * h
    return v * h + L * per_layer + h + head
