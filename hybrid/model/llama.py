"""Llama family: RMSNorm, SwiGLU, rotary positions (rotate-half layout), GQA, no biases.

Everything the rest of hybrid asks about Llama is here, registered as the family "llama": the
block choices (built by the shared blocks in `layers.py`), the analytic parameter count, the
even head dimension RoPE needs, and the transformers counterpart (LlamaForCausalLM): config
keywords and conversion rules (our fused `attn.qkv` is [q_proj | k_proj | v_proj], our fused
`mlp.up` is [gate_proj | up_proj]; RoPE uses the same rotate-half layout on both sides, so q and
k need no permutation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid.model.family import (
    Blocks,
    Family,
    HFCounterpart,
    ModelConfigError,
    ffn_hidden,
    kv_heads,
    positions_up_to_max,
    register_family,
)
from hybrid.model.hf import Rule
from hybrid.parallel.tp.tensor import padded_vocab

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybrid.config import ModelConfig


def llama_param_count(cfg: ModelConfig, vocab_size: int, tp: int = 1) -> int:
    """Parameters: V'h (+ V'h untied head) + L(h(h + 2·kv·d) + h² + 3·h·ffn + 2h) + h."""
    h, L, v = cfg.hidden, cfg.n_layers, padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    kv = kv_heads(cfg) * (h // cfg.n_heads)
    ffn = ffn_hidden(cfg)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    head = 0 if cfg.tie_embeddings else v * h
    return v * h + L * per_layer + h + head


def check_rope(cfg: ModelConfig) -> None:
    """RoPE rotates pairs of a head's features: the head dimension must be even."""
    if (cfg.hidden // cfg.n_heads) % 2:
        raise ModelConfigError("llama needs an even head dimension for RoPE")


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """LlamaConfig keywords; dropout on attention probabilities. The RoPE base goes in both spellings:
    transformers 5 reads `rope_parameters`, 4.x only `rope_theta`."""
    return {"hidden_size": cfg.hidden, "intermediate_size": ffn_hidden(cfg), "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": kv_heads(cfg),
            "head_dim": cfg.hidden // cfg.n_heads, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.dropout}


def hf_rules(cfg: ModelConfig) -> dict[str, Rule]:
    """Our global names ← LlamaForCausalLM's; fused projections are row concatenations."""
    q = cfg.n_heads * (cfg.hidden // cfg.n_heads)
    kv = kv_heads(cfg) * (cfg.hidden // cfg.n_heads)
    ffn = ffn_hidden(cfg)
    rules = {"tok_embed.weight": Rule(("model.embed_tokens.weight",), vocab=True)}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules |= {
            f"{ours}.attn_norm.weight": Rule((f"{theirs}.input_layernorm.weight",)),
            f"{ours}.attn.qkv.weight": Rule(tuple(f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"), (q, kv, kv)),
            f"{ours}.attn.proj.weight": Rule((f"{theirs}.self_attn.o_proj.weight",)),
            f"{ours}.mlp_norm.weight": Rule((f"{theirs}.post_attention_layernorm.weight",)),
            f"{ours}.mlp.up.weight": Rule((f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight"),
                                          (ffn, ffn)),
            f"{ours}.mlp.down.weight": Rule((f"{theirs}.mlp.down_proj.weight",)),
        }
    rules["norm.weight"] = Rule(("model.norm.weight",))
    return rules


def hf_shape(hf: PretrainedConfig) -> dict[str, Any]:
    """The fields of a LlamaConfig that fix our tensors and numerics, under our names (defaults
    resolved as transformers resolves them; max_position_embeddings is only the RoPE cache length)."""
    rope = getattr(hf, "rope_parameters", None) or {}
    return {"n_layers": hf.num_hidden_layers, "hidden": hf.hidden_size, "n_heads": hf.num_attention_heads,
            "n_kv_heads": hf.num_key_value_heads, "ffn_hidden": hf.intermediate_size,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            "norm_eps": hf.rms_norm_eps, "rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
            "rope_type": rope.get("rope_type", "default"), "tie_embeddings": hf.tie_word_embeddings,
            "activation": hf.hidden_act, "bias": bool(hf.attention_bias or hf.mlp_bias)}


LLAMA = register_family(Family(
    name="llama",
    blocks=Blocks(norm="rms", mlp="swiglu", bias=False, positions="rope"),
    param_count=llama_param_count,
    check=check_rope,
    check_seq_len=positions_up_to_max("the RoPE tables' positions"),  # transformers' max_position_embeddings
    hf=HFCounterpart(model_type="llama", config_class="LlamaConfig", lm_class="LlamaForCausalLM",
                     config=hf_config_kwargs, rules=hf_rules, shape=hf_shape),
))
