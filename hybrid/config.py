"""Structured configuration: one dataclass per Hydra config group, and `validate`.

Hydra composes `configs/config.yaml` and the groups `model/`, `parallel/`, `data/`, `optim/`, `compression/`
against these schemas, so an unknown key or a value of the wrong type is rejected before anything runs.
`validate(cfg, world_size)` then checks everything knowable before a process group exists, and raises
`ConfigError` with one readable line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hybrid.parallel.schedules import SCHEDULES, ScheduleError, check_sizes

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout


class ConfigError(ValueError):
    """Bad user input (config, data path, command line): reported as one line, exit 2."""


@dataclass
class ModelConfig:
    name: str = "gpt-tiny"  # label only; the config file name
    family: str = "gpt"  # gpt (GPT-2: LayerNorm, GELU, learned positions, tied) | llama | any registered family
    n_layers: int = 4  # transformer blocks
    hidden: int = 256  # model width h
    n_heads: int = 4  # attention heads
    n_kv_heads: Optional[int] = None  # key/value heads (GQA); None = n_heads
    ffn_hidden: Optional[int] = None  # MLP inner width; None = 4h (gpt)
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary size
    make_vocab_size_divisible_by: int = 128  # embedding rows padded to a multiple of this · tp
    max_seq_len: int = 1024  # learned positions (gpt) / RoPE cache length (llama)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # llama only
    tie_embeddings: bool = True  # output head shares the token embedding
    dropout: float = 0.0  # attention/residual dropout probability
    init_std: float = 0.02  # normal init std; output projections scaled by 1/sqrt(2L)
    init_from: Optional[str] = None  # transformers folder (config.json + weights) to start from; a resume wins


@dataclass
class ParallelConfig:
    name: str = "single"  # label only; the config file name
    tp: int = 1  # tensor-parallel size (ranks inside one node)
    pp: int = 1  # pipeline stages
    dp: Optional[int] = None  # data-parallel size; None = world / (tp·pp)
    schedule: str = "1f1b"  # a name in hybrid.parallel.schedules.SCHEDULES: gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    stage_layers: Optional[list[int]] = None  # layers per model part (pp·virtual_stages counts); None = balanced
    sequence_parallel: bool = False  # split norms/dropout along the sequence inside TP
    ranks_per_node: Optional[int] = None  # override of the detected node size (emulated nodes)
    allow_tp_across_nodes: bool = False  # permit a TP group spanning nodes (warns)
    bucket_mb: float = 25.0  # DP gradient bucket size in MB (fp32)


@dataclass
class DataConfig:
    name: str = "default"  # label only
    path: Optional[str] = MISSING  # local .txt/.jsonl/.json/.parquet file or folder; null = embedded corpus
    text_field: str = "text"  # column holding the text in jsonl/parquet files
    tokenizer: Optional[str] = None  # local transformers tokenizer folder; None = BPE trained on the corpus
    vocab_size: int = 8192  # vocabulary of the BPE trained when `tokenizer` is None
    seq_len: int = 128  # tokens per training sequence
    eval_fraction: float = 0.01  # share of the packed sequences held out for eval
    cache_dir: Optional[str] = None  # None = $HYBRID_CACHE or ~/.cache/hybrid
    max_chars: Optional[int] = None  # cap on corpus characters read (quick experiments)


@dataclass
class OptimConfig:
    name: str = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings' padding
    warmup_steps: int = 10  # linear warmup from 0 to train.lr
    min_lr_ratio: float = 0.1  # cosine decays to train.lr · min_lr_ratio at train.steps
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class CompressionConfig:
    # none | fp16 | bf16 | int8 | sign | topk | powersgd | hierarchical | torch_fp16 | torch_bf16 | torch_powersgd
    method: str = "none"
    rank: int = 4  # powersgd, torch_powersgd: rank of the low-rank factors
    fraction: float = 0.01  # topk: fraction of each chunk's elements sent, in (0, 1]
    block_size: int = 256  # int8, sign: elements sharing one fp32 scale
    error_feedback: bool = True  # sign, topk, powersgd, torch_powersgd: add last step's compression error back
    warmup_steps: int = 0  # steps of exact all-reduce before compressing
    min_compression_rate: float = 2.0  # powersgd: compress a matrix only if its factors are this much smaller
    seed: int = 0  # powersgd: seed of the first random factors (shared by the DP ranks)
    inner: str = ""  # hierarchical: the method between nodes (exact inside a node)
    measure_error: bool = True  # logged steps: one extra exact all-reduce to report compression_error


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    seed: int = 1234  # weights, data order, dropout
    micro_batch_size: int = 8  # sequences per microbatch per DP rank
    global_batch_size: int = 32  # sequences per step = micro batch · microbatches · dp
    lr: float = 3e-3  # peak learning rate
    eval_every: int = 25  # steps between evals; 0 disables
    eval_batches: int = 2  # held-out global batches (of global_batch_size sequences) per eval
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class CheckpointFields:
    dir: str = "checkpoints"  # root folder; a run writes <dir>/<run>/step_XXXXXXX
    every: int = 0  # steps between saves; 0 disables
    keep: int = 3  # newest checkpoints kept
    resume: str = "none"  # none | auto | <path>


# `checkpoint.async` (overlap the write with training) is a Python keyword, so the schema adds it to
# CheckpointFields by name; type checkers see CheckpointFields (read the flag as getattr(c, "async")).
if TYPE_CHECKING:
    CheckpointConfig = CheckpointFields
else:
    CheckpointConfig = dataclasses.dataclass(init=False, repr=False, eq=False)(
        type("CheckpointConfig", (CheckpointFields,), {"__annotations__": {"async": bool}, "async": False}))


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "hybrid"
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    dir: str = "runs/${run_name}"  # everything of a run lives here
    log_every: int = 1  # steps between metrics.jsonl lines
    progress: bool = True  # progress bar on rank 0
    timing: bool = True  # logged steps: time every collective (comm/ keys) and break the step down (time/ keys)
    traffic_map: bool = True  # the last step's bytes rank → rank: traffic.json (+ traffic.png with matplotlib)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # [first, last]: torch.profiler traces of these steps
    dir: str = "${logging.dir}/profile"  # one Chrome/Perfetto trace per rank (+ a CUDA memory snapshot)
    memory: bool = True  # on CUDA, also record a memory snapshot of the profiled steps


@dataclass
class Config:
    run_name: str = "${model.name}-${parallel.name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The composed config for `overrides` (as on the command line), without running Hydra's app.

    Tools, benchmarks and tests use it; `hybrid.train` uses @hydra.main on the same files.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return cast(Config, compose(config_name="config", overrides=list(overrides)))  # duck-typed
    finally:
        GlobalHydra.instance().clear()


def register_configs() -> None:
    """Register the root schema; `configs/config.yaml` lists it first in its defaults, so every
    group file merged under `model`, `parallel`, … is typed by that group's dataclass."""
    ConfigStore.instance().store(name="schema", node=Config)


_CHOICES = {
    "parallel.schedule": SCHEDULES,  # the registry: its names
    "train.precision": ("auto", "fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
}


def _get(cfg: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config, world_size: int, ranks_per_node: Optional[int] = None) -> Layout:
    """Check everything knowable before groups exist; return the layout. Raises ConfigError.

    `ranks_per_node` is the detected node size (torchrun's LOCAL_WORLD_SIZE);
    `parallel.ranks_per_node` overrides it.
    """
    from hybrid.model.family import family_names
    from hybrid.parallel.context import Layout, LayoutError

    _validate_compression(cfg.compression)
    for key, allowed in ({"model.family": family_names()} | _CHOICES).items():
        _require(_get(cfg, key) in allowed, f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}")
    p, m, t = cfg.parallel, cfg.model, cfg.train
    try:
        layout = Layout.create(world_size, p.tp, p.pp, p.dp, p.ranks_per_node or ranks_per_node,
                               p.allow_tp_across_nodes)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    _validate_model(m, p.tp)
    _require(p.virtual_stages >= 1, f"parallel.virtual_stages must be >= 1, got {p.virtual_stages}")
    _require(m.n_layers >= p.pp * p.virtual_stages,
             f"model.n_layers={m.n_layers} is fewer than pp·virtual_stages = {p.pp * p.virtual_stages}")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb must be > 0, got {p.bucket_mb}")
    _require(t.steps >= 0, f"train.steps must be >= 0, got {t.steps}")
    _require(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    per_step = t.micro_batch_size * layout.dp
    _require(t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size} is not a multiple of "
             f"micro_batch_size·dp = {t.micro_batch_size}·{layout.dp} = {per_step}")
    _validate_pipeline(p, m, t.global_batch_size // per_step)
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(t.eval_every >= 0 and t.eval_batches >= 1, "train.eval_every must be >= 0 and eval_batches >= 1")
    _validate_data(cfg.data, m)
    if p.sequence_parallel:
        _require(cfg.data.seq_len % p.tp == 0, f"parallel.sequence_parallel=true needs "
                 f"data.seq_len={cfg.data.seq_len} divisible by parallel.tp={p.tp}")
    _require(cfg.optim.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {cfg.optim.grad_clip}")
    _require(cfg.optim.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {cfg.optim.warmup_steps}")
    _require(cfg.logging.log_every >= 1, f"logging.log_every must be >= 1, got {cfg.logging.log_every}")
    _validate_checkpoint(cfg.checkpoint)
    s = list(cfg.profile.steps)
    _require(not s or (len(s) == 2 and 1 <= s[0] <= s[1] <= t.steps),
             f"profile.steps={s} must be [] or [first, last] with 1 <= first <= last <= train.steps={t.steps}")
    return layout


def _validate_pipeline(p: ParallelConfig, m: ModelConfig, microbatches: int) -> None:
    """Schedule sizes (interleaving needs pp >= 2 and microbatches divisible by pp) and stage_layers."""
    from hybrid.parallel.pipeline import partition_layers

    spec = SCHEDULES[p.schedule]
    _require(p.virtual_stages >= spec.min_virtual_stages, f"parallel.schedule={p.schedule} needs "
             f"parallel.virtual_stages >= {spec.min_virtual_stages} ({spec.fewer_virtual})")
    if p.pp > 1 or p.virtual_stages > 1:
        try:
            check_sizes(p.schedule, p.pp, microbatches, p.virtual_stages)
        except ScheduleError as e:
            raise ConfigError(f"parallel.schedule={p.schedule}: {e}") from None
    if p.stage_layers is not None:
        try:
            partition_layers(m.n_layers, p.pp * p.virtual_stages, p.stage_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _validate_compression(c: CompressionConfig) -> None:
    """The compression package's own check, its CompressionError reported as bad input."""
    from hybrid.compression import CompressionError
    from hybrid.compression.hooks import check

    try:
        check(c)
    except CompressionError as e:
        raise ConfigError(str(e)) from None


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every >= 0, f"checkpoint.every must be >= 0 (0 disables saving), got {c.every}")
    _require(c.keep >= 0, f"checkpoint.keep must be >= 0 (0 keeps all), got {c.keep}")
    _require(bool(str(c.resume).strip()), "checkpoint.resume must be none, auto or a checkpoint path")
    _require(bool(str(c.dir).strip()), "checkpoint.dir must not be empty")


def _validate_model(m: ModelConfig, tp: int) -> None:
    from hybrid.model.family import family_of

    for key in ("n_layers", "hidden", "n_heads", "max_seq_len", "make_vocab_size_divisible_by"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1, got {getattr(m, key)}")
    _require(m.hidden % m.n_heads == 0, f"model.hidden={m.hidden} is not divisible by model.n_heads={m.n_heads}")
    kv = m.n_kv_heads or m.n_heads
    _require(kv >= 1 and m.n_heads % kv == 0,
             f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    _require(m.n_heads % tp == 0, f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}")
    _require(kv % tp == 0, f"model.n_kv_heads={kv} is not divisible by parallel.tp={tp}")
    ffn = m.ffn_hidden or 4 * m.hidden
    _require(ffn % tp == 0, f"model.ffn_hidden={ffn} is not divisible by parallel.tp={tp}")
    _require(m.vocab_size is None or m.vocab_size >= 1, f"model.vocab_size must be >= 1, got {m.vocab_size}")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")
    with _model_input():
        family_of(m).check(m)
    _require(m.init_from is None or (Path(m.init_from) / "config.json").is_file(),
             f"model.init_from={m.init_from} is not a transformers model folder (a directory with config.json)")


@contextlib.contextmanager
def _model_input() -> Iterator[None]:
    """The model package's ModelConfigError (bad model input) is our one-line ConfigError."""
    from hybrid.model.family import ModelConfigError

    try:
        yield
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None


def _validate_data(d: DataConfig, m: ModelConfig) -> None:
    import os

    from omegaconf import OmegaConf

    from hybrid.model.family import family_of

    for key in ("path", "tokenizer"):
        _require(not OmegaConf.is_missing(d, key), f"data.{key} is required by data={d.name} (set data.{key}=...)")
    _require(d.seq_len >= 1, f"data.seq_len must be >= 1, got {d.seq_len}")
    with _model_input():
        family_of(m).check_seq_len(m, d.seq_len)
    if d.path is not None:
        _require(os.path.exists(d.path), f"data.path={d.path} does not exist")
    if d.tokenizer is not None:
        _require(os.path.isdir(d.tokenizer), f"data.tokenizer={d.tokenizer} is not a directory")
    _require(d.vocab_size >= 256 + 1, f"data.vocab_size must be > 256 (byte-level BPE), got {d.vocab_size}")
    _require(0.0 < d.eval_fraction < 1.0, f"data.eval_fraction must be in (0, 1), got {d.eval_fraction}")
