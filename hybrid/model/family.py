"""The family seam: what makes GPT-2 GPT-2 and Llama Llama, and the registry that names them.

A `Family` is a record: the block choices its model is built from (`Blocks`: the norm, the
MLP, biases, positions — `layers.py` builds any combination), and the functions only the family
knows: its closed-form parameter count, its checks on a ModelConfig (and on the data's sequence
length), the fields that fix its tensor shapes (what a checkpoint must match to resume), and its
transformers counterpart (`HFCounterpart`: config, conversion rules, model type) if it has one.

Each family lives in its own module (`gpt.py`, `llama.py`) and registers itself with
`register_family` when `hybrid.model` is imported; everything else asks `family_of(cfg)` /
`get_family(name)` instead of comparing names. `docs/extending.md` shows how to add one.

No collectives here. Bad model input raises `ModelConfigError`; `hybrid.validation.validate` and the
command-line entry points turn it into their one-line `ConfigError` (this package never imports
`hybrid.config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybrid.config import ModelConfig

NORMS = ("layernorm", "rms")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


class ModelConfigError(ValueError):
    """A model config (or a transformers folder) that cannot make this model: one readable line."""


@dataclass(frozen=True)
class Blocks:
    """The resolved block choices the shared blocks in `layers.py` are built from.

    norm: "layernorm" (weight and bias) or "rms" (weight only); mlp: "gelu" (fc1 → GELU(tanh) → fc2)
    or "swiglu" (fused gate|up → SiLU(gate)·up → down); bias: biases on the attention and MLP
    projections (never on the head); positions: "learned" (an embedding of max_seq_len rows added
    to the tokens) or "rope" (rotary, rotate-half layout, on q and k).
    """

    norm: str
    mlp: str
    bias: bool
    positions: str

    def __post_init__(self) -> None:
        for what, value, allowed in (("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS),
                                     ("positions", self.positions, POSITIONS)):
            if value not in allowed:
                raise ValueError(f"Blocks.{what}={value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class HFCounterpart:
    """A family's transformers model: what `hybrid.model.hf` needs to convert, import and export.

    `config(cfg)` gives the family's config keywords (shapes and numerics; hf.py adds the vocabulary,
    tying, init range and token ids); `rules(cfg)` maps every global parameter name but an untied
    head to a `hybrid.model.hf.Rule`; `shape(hf_config)` reads the fields that fix our tensors and
    numerics under our ModelConfig names, in the order a mismatch is reported.
    """

    model_type: str  # transformers' config.model_type, e.g. "gpt2"
    config_class: str  # the transformers config class, e.g. "GPT2Config"
    lm_class: str  # the transformers LM class, e.g. "GPT2LMHeadModel"
    config: Callable[[ModelConfig], dict[str, Any]]
    rules: Callable[[ModelConfig], dict[str, Any]]
    shape: Callable[[PretrainedConfig], dict[str, Any]]


def no_check(*_: Any) -> None:
    """A check that accepts everything."""


def positions_up_to_max(what: str) -> Callable[[ModelConfig, int], None]:
    """A `check_seq_len` for a family with `model.max_seq_len` positions (`what` holds them): a longer
    sequence has no position, so it is a ModelConfigError."""
    def check(cfg: ModelConfig, seq_len: int) -> None:
        if seq_len > cfg.max_seq_len:
            raise ModelConfigError(f"data.seq_len={seq_len} exceeds model.max_seq_len={cfg.max_seq_len} ({what})")

    return check


def ffn_hidden(cfg: ModelConfig) -> int:
    """The MLP inner width: `ffn_hidden`, or 4h."""
    return cfg.ffn_hidden or 4 * cfg.hidden


def kv_heads(cfg: ModelConfig) -> int:
    """The key/value heads: `n_kv_heads`, or one per query head."""
    return cfg.n_kv_heads or cfg.n_heads


def base_shape(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """The fields that fix every family's tensor shapes (layout aside)."""
    return {"family": cfg.family, "n_layers": cfg.n_layers, "hidden": cfg.hidden, "n_heads": cfg.n_heads,
            "n_kv_heads": kv_heads(cfg), "ffn_hidden": ffn_hidden(cfg), "vocab_size": vocab,
            "tie_embeddings": cfg.tie_embeddings}


@dataclass(frozen=True)
class Family:
    """One model family: its block choices and the functions only it knows.

    param_count(cfg, vocab_size, tp): the whole model's parameters, vocabulary padded for tp.
    check(cfg): raise ModelConfigError if the family cannot build `cfg`.
    check_seq_len(cfg, seq_len): raise ModelConfigError if it cannot run sequences of `seq_len`.
    shape(cfg, vocab): the fields that fix the tensor shapes (a resume must match them).
    hf: the transformers counterpart, or None (no conversion, import or export).
    """

    name: str
    blocks: Blocks
    param_count: Callable[[ModelConfig, int, int], int]
    check: Callable[[ModelConfig], None] = no_check
    check_seq_len: Callable[[ModelConfig, int], None] = no_check
    shape: Callable[[ModelConfig, int], dict[str, Any]] = base_shape
    hf: Optional[HFCounterpart] = None


_FAMILIES: dict[str, Family] = {}  # the registry: filled by the family modules at import


def register_family(family: Family) -> Family:
    """Make `family` known by its name (to `model.family`, building, checks, conversion).

    Registering the same record twice is harmless; another record under a taken name is an error.
    """
    known = _FAMILIES.get(family.name)
    if known is not None and known != family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def family_names() -> tuple[str, ...]:
    """The registered family names, in registration order (gpt, llama, then any added)."""
    return tuple(_FAMILIES)


def get_family(name: str) -> Family:
    """The family registered as `name`; ModelConfigError naming the known ones otherwise."""
    if name not in _FAMILIES:
        raise ModelConfigError(f"model.family={name!r} is not one of {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(cfg: ModelConfig) -> Family:
    """The family of a ModelConfig (`cfg.family`)."""
    return get_family(cfg.family)
