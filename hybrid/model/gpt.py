"""GPT-2 family: LayerNorm, GELU(tanh), learned positions, biases, tied embeddings.

The blocks live in `layers.py`; this module names the family's analytic parameter count,
which start-up prints next to the counted one.
"""

from __future__ import annotations

from typing import Any

from hybrid.parallel.tensor import padded_vocab


def gpt_param_count(cfg: Any, vocab_size: int, tp: int = 1) -> int:
    """Parameters of the whole model: V'h + S·h + L(12h² + 13h) + 2h (+ V'h if untied).

    V' is the padded vocabulary, S the learned positions; per layer QKV 3h²+3h, proj h²+h,
    fc1 4h²+4h, fc2 4h²+h, two LayerNorms 4h.
    """
    h, L, v = cfg.hidden, cfg.n_layers, padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    ffn = cfg.ffn_hidden or 4 * h
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h
    head = 0 if cfg.tie_embeddings else v * h
    return v * h + cfg.max_seq_len * h + L * per_layer + 2 * h + head
