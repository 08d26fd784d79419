"""GPT-2 family: LayerNorm, GELU(tanh), learned positions, biases, tied embeddings by default.

Everything the rest of hybrid asks about GPT-2 is here, registered as the family "gpt": the
block choices (built by the shared blocks in `layers.py`), the analytic parameter count that
start-up prints next to the counted one, the learned positions' bound on the sequence length,
the shape fields a resume must match, and the transformers counterpart (GPT2LMHeadModel):
config keywords and conversion rules (GPT-2's `Conv1D` stores [in, out], the transpose of
our `nn.Linear`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid.model.family import (
    Blocks,
    Family,
    HFCounterpart,
    base_shape,
    ffn_hidden,
    positions_up_to_max,
    register_family,
)
from hybrid.model.hf import Rule
from hybrid.parallel.tp.tensor import padded_vocab

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybrid.config import ModelConfig


def gpt_param_count(cfg: ModelConfig, vocab_size: int, tp: int = 1) -> int:
    """Parameters of the whole model: V'h + S·h + L(12h² + 13h) + 2h (+ V'h if untied).

    V' is the padded vocabulary, S the learned positions; per layer QKV 3h²+3h, proj h²+h,
    fc1 4h²+4h, fc2 4h²+h, two LayerNorms 4h.
    """
    h, L, v = cfg.hidden, cfg.n_layers, padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    ffn = ffn_hidden(cfg)
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h
    head = 0 if cfg.tie_embeddings else v * h
    return v * h + cfg.max_seq_len * h + L * per_layer + 2 * h + head


check_learned_positions = positions_up_to_max("learned positions")
"""Learned positions have max_seq_len rows: longer sequences have no position to embed."""


def learned_positions_shape(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """The common shape fields, and max_seq_len: the rows of the learned position embedding."""
    return base_shape(cfg, vocab) | {"max_seq_len": cfg.max_seq_len}


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """GPT2Config keywords. Dropout on attention probabilities and residual branches; we have no
    embedding dropout, so `embd_pdrop=0`."""
    return {"n_positions": cfg.max_seq_len, "n_embd": cfg.hidden, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": ffn_hidden(cfg), "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "embd_pdrop": 0.0}


def hf_rules(cfg: ModelConfig) -> dict[str, Rule]:
    """Our global names ← GPT2LMHeadModel's; linear weights transposed (Conv1D is [in, out])."""
    rules = {"tok_embed.weight": Rule(("transformer.wte.weight",), vocab=True),
             "pos_embed.weight": Rule(("transformer.wpe.weight",))}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for mine, hf, linear in [("attn_norm", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                                 ("attn.proj", "attn.c_proj", True), ("mlp_norm", "ln_2", False),
                                 ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)]:
            rules[f"{ours}.{mine}.weight"] = Rule((f"{theirs}.{hf}.weight",), transpose=linear)
            rules[f"{ours}.{mine}.bias"] = Rule((f"{theirs}.{hf}.bias",))
    rules["norm.weight"] = Rule(("transformer.ln_f.weight",))
    rules["norm.bias"] = Rule(("transformer.ln_f.bias",))
    return rules


def hf_shape(hf: PretrainedConfig) -> dict[str, Any]:
    """The fields of a GPT2Config that fix our tensors and numerics, under our names (max_seq_len,
    the learned positions, reported last)."""
    return {"n_layers": hf.n_layer, "hidden": hf.n_embd, "n_heads": hf.n_head, "n_kv_heads": hf.n_head,
            "ffn_hidden": hf.n_inner or 4 * hf.n_embd, "norm_eps": hf.layer_norm_epsilon,
            "tie_embeddings": hf.tie_word_embeddings, "activation": hf.activation_function,
            "max_seq_len": hf.n_positions}


GPT = register_family(Family(
    name="gpt",
    blocks=Blocks(norm="layernorm", mlp="gelu", bias=True, positions="learned"),
    param_count=gpt_param_count,
    check_seq_len=check_learned_positions,
    shape=learned_positions_shape,
    hf=HFCounterpart(model_type="gpt2", config_class="GPT2Config", lm_class="GPT2LMHeadModel",
                     config=hf_config_kwargs, rules=hf_rules, shape=hf_shape),
))
