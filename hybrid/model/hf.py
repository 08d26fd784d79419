"""State-dict conversion between our models and transformers' GPT2LMHeadModel / LlamaForCausalLM.

Our parameters carry *global* names (`layers.17.attn.qkv.weight`) and global shapes, except
that the token embedding (and an untied head) has the padded vocabulary's rows. Conversion
is a table of rules, one per global name, each saying which transformers tensor(s) it comes
from and how:

- fused projections are a concatenation along rows: our `attn.qkv` is [Q | K | V]
  (Llama's `q_proj`, `k_proj`, `v_proj`), Llama's `mlp.up` is [gate | up];
- GPT-2's `Conv1D` stores weights as [in, out], the transpose of our `nn.Linear` [out, in];
- vocabulary rows beyond `vocab_size` exist only on our side (zero-filled on import,
  stripped on export);
- Llama RoPE uses the same rotate-half layout on both sides, so q/k need no permutation.

`load_hf_into` fills a model that may be one pipeline stage and/or one TP rank: every
parameter's global tensor is built from the rule of its global name and cut with its
`hybrid_shard`. Exporting a tp>1 model (`export_hf_state_dict`) first gathers each
parameter's shards into the global tensor (the inverse of `Shard.slice`), then calls
`to_hf_state_dict`; the model must hold every layer, embedding and head (no pipeline stage).

`load_pretrained` (`model.init_from`) fills a rank's chunks from a transformers folder: its
config must match the model (`check_hf_config`: family, shapes, vocabulary, tying, norm eps, RoPE,
activation; a mismatch is a ConfigError naming the fields), its tensors are read lazily by name
(`HFTensors`: model.safetensors, a sharded index, or pytorch_model.bin), then `load_hf_into`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig, PretrainedConfig

from hybrid.config import ConfigError
from hybrid.parallel import collectives as C
from hybrid.parallel.tensor import full_state_dict, padded_vocab


@dataclass(frozen=True)
class Rule:
    """How one of our global tensors is made from transformers' tensors.

    `hf` keys are concatenated along dim 0 (after transposing each if `transpose`);
    `split` gives their row counts on our side; `vocab` marks padded-vocabulary rows.
    """

    hf: tuple[str, ...]
    split: tuple[int, ...] = ()
    transpose: bool = False
    vocab: bool = False


def _ffn(cfg: Any) -> int:
    return cfg.ffn_hidden or 4 * cfg.hidden


def _kv_heads(cfg: Any) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def hf_config(cfg: Any, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """A transformers GPT2Config or LlamaConfig with the shape and numerics of `cfg`.

    The vocabulary is the real (unpadded) one. Dropout: GPT-2 gets `cfg.dropout` on attention
    probabilities and residual branches (we have no embedding dropout, so `embd_pdrop=0`);
    Llama gets it on attention probabilities. Token ids default to None (the tokenizer's
    export sets them); `overrides` are passed to the config unchanged.
    """
    common: dict[str, Any] = {"vocab_size": vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
                              "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None,
                              "pad_token_id": None}
    if cfg.family == "gpt":
        return GPT2Config(**(common | _gpt2_kwargs(cfg) | overrides))
    if cfg.family == "llama":
        return LlamaConfig(**(common | _llama_kwargs(cfg) | overrides))
    raise ValueError(f"model.family={cfg.family!r} has no transformers counterpart")


def _gpt2_kwargs(cfg: Any) -> dict[str, Any]:
    return {"n_positions": cfg.max_seq_len, "n_embd": cfg.hidden, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": _ffn(cfg), "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "embd_pdrop": 0.0}


def _llama_kwargs(cfg: Any) -> dict[str, Any]:
    return {"hidden_size": cfg.hidden, "intermediate_size": _ffn(cfg), "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": _kv_heads(cfg),
            "head_dim": cfg.hidden // cfg.n_heads, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout}


def _gpt_rules(cfg: Any) -> dict[str, Rule]:
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


def _llama_rules(cfg: Any) -> dict[str, Rule]:
    q = cfg.n_heads * (cfg.hidden // cfg.n_heads)
    kv = _kv_heads(cfg) * (cfg.hidden // cfg.n_heads)
    rules = {"tok_embed.weight": Rule(("model.embed_tokens.weight",), vocab=True)}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules |= {
            f"{ours}.attn_norm.weight": Rule((f"{theirs}.input_layernorm.weight",)),
            f"{ours}.attn.qkv.weight": Rule(tuple(f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"), (q, kv, kv)),
            f"{ours}.attn.proj.weight": Rule((f"{theirs}.self_attn.o_proj.weight",)),
            f"{ours}.mlp_norm.weight": Rule((f"{theirs}.post_attention_layernorm.weight",)),
            f"{ours}.mlp.up.weight": Rule((f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight"),
                                          (_ffn(cfg), _ffn(cfg))),
            f"{ours}.mlp.down.weight": Rule((f"{theirs}.mlp.down_proj.weight",)),
        }
    rules["norm.weight"] = Rule(("model.norm.weight",))
    return rules


def conversion_rules(cfg: Any) -> dict[str, Rule]:
    """Rules for every global parameter name of the whole model of `cfg`, in our order."""
    if cfg.family not in ("gpt", "llama"):
        raise ValueError(f"model.family={cfg.family!r} has no transformers counterpart")
    rules = _gpt_rules(cfg) if cfg.family == "gpt" else _llama_rules(cfg)
    if not cfg.tie_embeddings:
        rules["head.weight"] = Rule(("lm_head.weight",), vocab=True)
    return rules


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (deterministic padding of the vocabulary)."""
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit the padded {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def _import(rule: Rule, hf_state: Mapping[str, torch.Tensor], vocab_rows: int) -> torch.Tensor:
    missing = [k for k in rule.hf if k not in hf_state]
    if missing:
        raise KeyError(f"transformers state dict lacks {', '.join(missing)}")
    parts = [hf_state[k].t() if rule.transpose else hf_state[k] for k in rule.hf]
    full = torch.cat(parts) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)
    if rule.vocab:
        full = _pad_rows(full, vocab_rows)
    return full.contiguous()


def _export(rule: Rule, t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    if rule.vocab:
        t = t[:vocab_size]
    parts = t.split(list(rule.split)) if rule.split else (t,)
    return {k: (p.t() if rule.transpose else p).clone(memory_format=torch.contiguous_format)
            for k, p in zip(rule.hf, parts, strict=True)}


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full (unsharded, global-name) state dict → transformers' LM state dict.

    Vocabulary padding is stripped. With tied embeddings `lm_head.weight` is the same tensor
    as the token embedding, as in transformers' own `state_dict()`; `load_state_dict(strict=True)`
    accepts the result. The model must be whole: a tp>1 or pipeline-split model is gathered first.
    """
    out: dict[str, torch.Tensor] = {}
    for name, rule in conversion_rules(cfg).items():
        if name not in state:
            raise KeyError(f"our state dict lacks {name} (export needs the whole, gathered model)")
        out |= _export(rule, state[name], vocab_size)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out[conversion_rules(cfg)["tok_embed.weight"].hf[0]]
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: Any, vocab_size: int,
                       tp: int = 1) -> dict[str, torch.Tensor]:
    """transformers' LM state dict → our full state dict with global names.

    Embedding (and untied head) rows are zero-padded to the vocabulary padded for `tp`
    (`padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)`). A tied
    `lm_head.weight` is ignored (it is the embedding).
    """
    rows = padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    return {name: _import(rule, hf_state, rows) for name, rule in conversion_rules(cfg).items()}


@torch.no_grad()
def load_hf_into(model: nn.Module, hf_state: Mapping[str, torch.Tensor], cfg: Any, vocab_size: int) -> None:
    """Copy transformers weights into `model`: whole, one pipeline stage, and/or one TP rank.

    For each of the model's own parameters (global names), the global tensor is built from
    `hf_state` and cut with the parameter's `hybrid_shard` (None = replicated). A tied head
    on a last stage that holds no embedding takes the embedding's weights. Only the tensors
    this model holds are converted.
    """
    rules = conversion_rules(cfg)
    tp = C.size(getattr(model, "tp_group", None))
    rows = getattr(model, "padded_vocab", padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp))
    for name, p in model.named_parameters():
        key = "tok_embed.weight" if name == "head.weight" and cfg.tie_embeddings else name
        if key not in rules:
            raise KeyError(f"no transformers counterpart for parameter {name}")
        full = _import(rules[key], hf_state, rows)
        shard = getattr(p, "hybrid_shard", None)
        local = shard.slice(full) if shard is not None else full
        if local.shape != p.shape:
            raise ValueError(f"{name}: converted shape {tuple(local.shape)} != parameter shape {tuple(p.shape)}")
        p.copy_(local)


def _missing_parts(names: set[str], cfg: Any) -> list[str]:
    """What of the whole model `names` lacks: layer indices as ranges, other tensors by name."""
    missing = [n for n in conversion_rules(cfg) if n not in names]
    layers = sorted({int(n.split(".")[1]) for n in missing if n.startswith("layers.")})
    out = [n for n in missing if not n.startswith("layers.")]
    if layers:
        out.insert(0, f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1))
                   else "layers " + ", ".join(map(str, layers)))
    return out


def export_hf_state_dict(model: nn.Module, cfg: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """transformers' LM state dict of a whole, possibly TP-sharded, model; every TP rank gets it.

    A collective over `model.tp_group`: `full_state_dict` runs one `all_gather` per TP-sharded
    parameter (in `named_parameters` order, so every TP rank must call this together);
    replicated parameters are copied locally. At tp=1 no collective runs. Then
    `to_hf_state_dict` strips the vocabulary padding. The parts are checked before any
    communication, so a pipeline stage (missing layers, embedding, final norm or head) raises
    ValueError on every rank instead of hanging; pipeline export is not supported here.
    """
    names = {n for n, _ in model.named_parameters()}
    missing = _missing_parts(names, cfg)
    if missing:
        raise ValueError(f"export_hf_state_dict needs the whole model, but this one (a pipeline stage?) lacks "
                         f"{'; '.join(missing)}; exporting pipeline-parallel models is not supported")
    ours = getattr(model, "vocab_size", vocab_size)
    if ours != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} but the model was built for a vocabulary of {ours}")
    return to_hf_state_dict(full_state_dict(model, getattr(model, "tp_group", None)), cfg, vocab_size)


# ---- model.init_from: a transformers folder as the starting point -----------------------------

HF_MODEL_TYPE = {"gpt": "gpt2", "llama": "llama"}


def hf_shape(hf: PretrainedConfig) -> dict[str, Any]:
    """The fields of a transformers GPT2Config / LlamaConfig that fix our tensors and numerics,
    under our ModelConfig names (defaults resolved as transformers resolves them)."""
    if hf.model_type == "gpt2":
        return {"n_layers": hf.n_layer, "hidden": hf.n_embd, "n_heads": hf.n_head, "n_kv_heads": hf.n_head,
                "ffn_hidden": hf.n_inner or 4 * hf.n_embd, "max_seq_len": hf.n_positions,
                "norm_eps": hf.layer_norm_epsilon, "tie_embeddings": hf.tie_word_embeddings,
                "activation": hf.activation_function}
    rope = getattr(hf, "rope_parameters", None) or {}
    return {"n_layers": hf.num_hidden_layers, "hidden": hf.hidden_size, "n_heads": hf.num_attention_heads,
            "n_kv_heads": hf.num_key_value_heads, "ffn_hidden": hf.intermediate_size,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            "norm_eps": hf.rms_norm_eps, "rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
            "rope_type": rope.get("rope_type", "default"), "tie_embeddings": hf.tie_word_embeddings,
            "activation": hf.hidden_act, "bias": bool(hf.attention_bias or hf.mlp_bias)}


def check_hf_config(hf: PretrainedConfig, cfg: Any, vocab_size: int, where: str) -> None:
    """ConfigError naming every field in which transformers config `hf` differs from `cfg` (the
    family, shapes, vocabulary, tying, norm eps, RoPE, activation): the weights would not fit, or
    would make another function."""
    want = HF_MODEL_TYPE.get(cfg.family)
    if hf.model_type != want:
        raise ConfigError(f"{where} holds a transformers {hf.model_type!r} model, but model.family={cfg.family} "
                          f"needs {want!r}")
    ref = hf_shape(hf_config(cfg, vocab_size))
    there = hf_shape(hf)
    diff = [f"{k}={there[k]} there, {v} here" for k, v in ref.items() if k != "max_seq_len" and there[k] != v]
    if cfg.family == "gpt" and there["max_seq_len"] != ref["max_seq_len"]:
        diff.append(f"max_seq_len={there['max_seq_len']} there, {ref['max_seq_len']} here")
    if hf.vocab_size != vocab_size:
        diff.append(f"vocab_size={hf.vocab_size} there, {vocab_size} here (set model.vocab_size)")
    if diff:
        raise ConfigError(f"{where} does not fit model={cfg.name}: {'; '.join(diff)}")


class HFTensors(Mapping[str, torch.Tensor]):
    """The tensors of a transformers folder, read lazily by name: `model.safetensors`, a sharded
    `model.safetensors.index.json`, or `pytorch_model.bin`. Names of a base model saved without
    its LM wrapper (`h.0...` for `transformer.h.0...`, `layers.0...` for `model.layers.0...`) resolve too."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._bin: dict[str, torch.Tensor] = {}
        self._files: dict[str, Any] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            opened = {f: safe_open(str(folder / f), "pt") for f in sorted(set(names.values()))}
            self._files = {k: opened[f] for k, f in names.items()}
        elif (folder / "model.safetensors").is_file():
            f = safe_open(str(folder / "model.safetensors"), "pt")
            self._files = dict.fromkeys(f.keys(), f)
        elif (folder / "pytorch_model.bin").is_file():
            self._bin = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise ConfigError(f"{folder} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")

    def _name(self, key: str) -> str:
        for name in (key, key.removeprefix("transformer."), key.removeprefix("model.")):
            if name in self._files or name in self._bin:
                return name
        raise KeyError(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self._name(key)
        return self._bin[name] if self._bin else self._files[name].get_tensor(name)

    def __contains__(self, key: object) -> bool:
        try:
            self._name(str(key))
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._bin or self._files)

    def __len__(self) -> int:
        return len(self._bin or self._files)


def load_pretrained(model: nn.ModuleList, folder: str | Path, cfg: Any, vocab_size: int) -> str:
    """Fill this rank's chunks (any layout: a pipeline part, a TP shard) with the weights of the
    transformers folder `folder` (`model.init_from`); returns a one-line summary.

    No collective: every rank reads the folder's config and the tensors its own parameters need
    (each global tensor, then its TP slice) and checks the same things, so a bad folder is the
    same ConfigError on every rank. Padding rows of the vocabulary start at zero.
    """
    from transformers import AutoConfig

    folder, where = Path(folder), f"model.init_from={folder}"
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where} is not a transformers model folder (no config.json)")
    try:
        hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable config is bad input)
        raise ConfigError(f"{where}: cannot read config.json ({type(e).__name__}: {_first_line(e)})") from None
    check_hf_config(hf, cfg, vocab_size, where)
    try:
        tensors = HFTensors(folder)
        for chunk in model:
            load_hf_into(chunk, tensors, cfg, vocab_size)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        raise ConfigError(f"{where}: cannot load its weights ({type(e).__name__}: {_first_line(e)})") from None
    return f"model: initialised from {folder} (transformers {hf.model_type}, {len(tensors)} tensors)"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().strip("'\"")
    return text.splitlines()[0] if text else ""
