"""State-dict conversion between our models and their transformers counterparts.

Our parameters carry *global* names (`layers.17.attn.qkv.weight`) and global shapes, except
that the token embedding (and an untied head) has the padded vocabulary's rows. Conversion
is a table of rules, one per global name, each saying which transformers tensor(s) it comes
from and how (`Rule`). The table, the config keywords and the model type are the family's
(`HFCounterpart` in `gpt.py`: GPT2LMHeadModel, `llama.py`: LlamaForCausalLM); this module is
the machinery every family shares:

- fused projections are a concatenation along rows (e.g. our `attn.qkv` is [Q | K | V]);
- a transposed rule stores [in, out] on the transformers side (GPT-2's `Conv1D`);
- vocabulary rows beyond `vocab_size` exist only on our side (zero-filled on import,
  stripped on export); an untied head is `lm_head.weight` in every family.

`load_hf_into` fills a model that may be one pipeline stage and/or one TP rank: every
parameter's global tensor is built from the rule of its global name and cut with its
TP `Shard` (`param_info(p).shard`). Exporting a tp>1 model (`export_hf_state_dict`) first gathers each
parameter's shards into the global tensor (the inverse of `Shard.slice`), then calls
`to_hf_state_dict`; the model must hold every layer, embedding and head (no pipeline stage).

`load_pretrained` (`model.init_from`) fills a rank's chunks from a transformers folder: its
config must match the model (`check_hf_config`: family, shapes, vocabulary, tying, norm eps, RoPE,
activation; a mismatch is a ModelConfigError naming the fields), its tensors are read lazily by name
(`HFTensors`: model.safetensors, a sharded index, or pytorch_model.bin), then `load_hf_into`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid.model.family import HFCounterpart, ModelConfigError, family_names, get_family
from hybrid.parallel import collectives as C
from hybrid.parallel.params import full_state_dict, param_info
from hybrid.parallel.tp.tensor import padded_vocab

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybrid.config import ModelConfig


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


def hf_counterpart(cfg: ModelConfig) -> HFCounterpart:
    """The transformers counterpart of `cfg.family`; ModelConfigError if it has none."""
    spec = get_family(cfg.family).hf if cfg.family in family_names() else None
    if spec is None:
        raise ModelConfigError(f"model.family={cfg.family!r} has no transformers counterpart")
    return spec


def hf_config(cfg: ModelConfig, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The family's transformers config (GPT2Config, LlamaConfig, ...) with the shape and numerics of `cfg`.

    The vocabulary is the real (unpadded) one; the family gives its own keywords (shapes, norm eps,
    activation, where dropout applies: `HFCounterpart.config`). Token ids default to None (the
    tokenizer's export sets them); `overrides` are passed to the config unchanged.
    """
    import transformers

    spec = hf_counterpart(cfg)
    common: dict[str, Any] = {"vocab_size": vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
                              "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None,
                              "pad_token_id": None}
    return getattr(transformers, spec.config_class)(**(common | spec.config(cfg) | overrides))


def conversion_rules(cfg: ModelConfig) -> dict[str, Rule]:
    """Rules for every global parameter name of the whole model of `cfg`, in our order: the
    family's (`HFCounterpart.rules`), then an untied head (`lm_head.weight` in every family)."""
    rules = dict(hf_counterpart(cfg).rules(cfg))
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


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
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


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int,
                       tp: int = 1) -> dict[str, torch.Tensor]:
    """transformers' LM state dict → our full state dict with global names.

    Embedding (and untied head) rows are zero-padded to the vocabulary padded for `tp`
    (`padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)`). A tied
    `lm_head.weight` is ignored (it is the embedding).
    """
    rows = padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    return {name: _import(rule, hf_state, rows) for name, rule in conversion_rules(cfg).items()}


@torch.no_grad()
def load_hf_into(model: nn.Module, hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> None:
    """Copy transformers weights into `model`: whole, one pipeline stage, and/or one TP rank.

    For each of the model's own parameters (global names), the global tensor is built from
    `hf_state` and cut with the parameter's TP shard (None = replicated). A tied head
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
        shard = param_info(p).shard
        local = shard.slice(full) if shard is not None else full
        if local.shape != p.shape:
            raise ValueError(f"{name}: converted shape {tuple(local.shape)} != parameter shape {tuple(p.shape)}")
        p.copy_(local)


def _missing_parts(names: set[str], cfg: ModelConfig) -> list[str]:
    """What of the whole model `names` lacks: layer indices as ranges, other tensors by name."""
    missing = [n for n in conversion_rules(cfg) if n not in names]
    layers = sorted({int(n.split(".")[1]) for n in missing if n.startswith("layers.")})
    out = [n for n in missing if not n.startswith("layers.")]
    if layers:
        out.insert(0, f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1))
                   else "layers " + ", ".join(map(str, layers)))
    return out


def export_hf_state_dict(model: nn.Module, cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
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

def check_hf_config(hf: PretrainedConfig, cfg: ModelConfig, vocab_size: int, where: str) -> None:
    """ModelConfigError naming every field in which transformers config `hf` differs from `cfg` (the
    family, shapes, vocabulary, tying, norm eps, RoPE, activation: the family's `HFCounterpart.shape`):
    the weights would not fit, or would make another function."""
    spec = hf_counterpart(cfg)
    if hf.model_type != spec.model_type:
        raise ModelConfigError(f"{where} holds a transformers {hf.model_type!r} model, but model.family={cfg.family} "
                               f"needs {spec.model_type!r}")
    ref, there = spec.shape(hf_config(cfg, vocab_size)), spec.shape(hf)
    diff = [f"{k}={there[k]} there, {v} here" for k, v in ref.items() if there[k] != v]
    if hf.vocab_size != vocab_size:
        diff.append(f"vocab_size={hf.vocab_size} there, {vocab_size} here (set model.vocab_size)")
    if diff:
        raise ModelConfigError(f"{where} does not fit model={cfg.name}: {'; '.join(diff)}")


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
            raise ModelConfigError(f"{folder} has no model.safetensors, model.safetensors.index.json or "
                                   "pytorch_model.bin")

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


def load_pretrained(model: nn.ModuleList, folder: str | Path, cfg: ModelConfig, vocab_size: int) -> str:
    """Fill this rank's chunks (any layout: a pipeline part, a TP shard) with the weights of the
    transformers folder `folder` (`model.init_from`); returns a one-line summary.

    No collective: every rank reads the folder's config and the tensors its own parameters need
    (each global tensor, then its TP slice) and checks the same things, so a bad folder is the
    same ModelConfigError on every rank. Padding rows of the vocabulary start at zero.
    """
    from transformers import AutoConfig

    folder, where = Path(folder), f"model.init_from={folder}"
    if not (folder / "config.json").is_file():
        raise ModelConfigError(f"{where} is not a transformers model folder (no config.json)")
    try:
        hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable config is bad input)
        raise ModelConfigError(f"{where}: cannot read config.json ({type(e).__name__}: {_first_line(e)})") from None
    check_hf_config(hf, cfg, vocab_size, where)
    try:
        tensors = HFTensors(folder)
        for chunk in model:
            load_hf_into(chunk, tensors, cfg, vocab_size)
    except ModelConfigError as e:
        raise ModelConfigError(f"{where}: {e}") from None
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        raise ModelConfigError(f"{where}: cannot load its weights ({type(e).__name__}: {_first_line(e)})") from None
    return f"model: initialised from {folder} (transformers {hf.model_type}, {len(tensors)} tensors)"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().strip("'\"")
    return text.splitlines()[0] if text else ""
