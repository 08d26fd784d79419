"""`validate(cfg, world_size)`: everything about a composed config that is knowable before a process
group exists. A bad value raises `ConfigError` with one readable line (turned into the CLI's error line
by `hybrid.cli`); the schemas themselves live in `hybrid.config`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import ListConfig

from hybrid.comm_watch import read_preflight
from hybrid.config import (
    CheckpointConfig,
    CompressionConfig,
    Config,
    ConfigError,
    DataConfig,
    HealthConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from hybrid.parallel.pp.schedules import SCHEDULES, ScheduleError, check_sizes
from hybrid.parallel.tp.comm import OVERLAP_MODES
from hybrid.sync import check as check_sync

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout


PRECISIONS = ("auto", "fp32", "bf16", "bf16_params")  # train.precision (hybrid-gpucheck's --settings too)
_CHOICES = {
    "parallel.schedule": SCHEDULES,  # the registry: its names
    "parallel.zb_memory": ("1f1b", "none"),
    "train.precision": PRECISIONS,
    "train.recompute": ("none", "selective", "full"),
    "train.fused_head": ("auto", "on", "off"),
    "train.compile_scope": ("blocks", "model"),
    "parallel.cp_comm": ("ring", "a2a"),
    "parallel.tp_overlap": OVERLAP_MODES,
    "train.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "train.on_nonfinite": ("stop", "skip", "rewind"),
    "health.comm_action": ("warn", "stop"),
    "optim.name": ("adamw", "sgd"),
    "optim.implementation": ("fused", "foreach"),
    "train.device": ("auto", "cpu", "cuda"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
}


def _get(cfg: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _validate_health(h: HealthConfig) -> None:
    _require(min(h.straggler_every, h.divergence_every, h.comm_checks, h.comm_warmup) >= 0,
             "health.straggler_every, divergence_every, comm_checks and comm_warmup must be >= 0 (0 = off / none), "
             f"got {h.straggler_every}, {h.divergence_every}, {h.comm_checks}, {h.comm_warmup}")
    _require(math.isfinite(h.straggler_threshold) and h.straggler_threshold > 0,
             f"health.straggler_threshold must be a finite number > 0, got {h.straggler_threshold}")
    _require(math.isfinite(h.comm_slowdown) and h.comm_slowdown > 1,
             f"health.comm_slowdown must be a finite number > 1 (times worse than the baseline), got {h.comm_slowdown}")
    _require(0 <= h.comm_min_share < 1, f"health.comm_min_share must be in [0, 1) (a share of the step), "
             f"got {h.comm_min_share}")
    _require(h.comm_baseline >= 1, f"health.comm_baseline must be >= 1 (timed steps), got {h.comm_baseline}")
    read_preflight(h.comm_preflight)  # a missing or unreadable file: one line


def layout_of(cfg: Config, world_size: int, ranks_per_node: Optional[int] = None) -> Layout:
    """`cfg.parallel`'s layout on `world_size` ranks (`parallel.ranks_per_node` over the detected node size), TP
    and CP kept inside nodes unless allowed; a layout that does not fit is a ConfigError."""
    from hybrid.parallel.context import Layout, LayoutError

    p = cfg.parallel
    try:
        return Layout.create(world_size, p.tp, p.pp, p.dp, p.ranks_per_node or ranks_per_node,
                             p.allow_tp_across_nodes, cp=p.cp, allow_cp_across_nodes=p.allow_cp_across_nodes)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: Config, world_size: int, ranks_per_node: Optional[int] = None) -> Layout:
    """Check everything knowable before groups exist; return the layout. Raises ConfigError.

    `ranks_per_node` is the detected node size (torchrun's LOCAL_WORLD_SIZE);
    `parallel.ranks_per_node` overrides it.
    """
    from hybrid.model.family import family_names

    _validate_compression(cfg.compression)
    for key, allowed in ({"model.family": family_names()} | _CHOICES).items():
        _require(_get(cfg, key) in allowed, f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}")
    p, m, t = cfg.parallel, cfg.model, cfg.train
    layout = layout_of(cfg, world_size, ranks_per_node)
    _validate_model(m, p.tp)
    _require(p.virtual_stages >= 1, f"parallel.virtual_stages must be >= 1, got {p.virtual_stages}")
    _require(m.n_layers >= p.pp * p.virtual_stages,
             f"model.n_layers={m.n_layers} is fewer than pp·virtual_stages = {p.pp * p.virtual_stages}")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb must be > 0, got {p.bucket_mb}")
    _require(math.isfinite(p.timeout_s) and p.timeout_s > 0, f"parallel.timeout_s must be > 0, got {p.timeout_s}")
    _require(math.isfinite(p.train_timeout_s) and p.train_timeout_s >= 0,
             f"parallel.train_timeout_s must be >= 0 (0: parallel.timeout_s throughout), got {p.train_timeout_s}")
    _require(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    per_step = t.micro_batch_size * layout.dp
    _require(t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size} is not a multiple of "
             f"micro_batch_size·dp = {t.micro_batch_size}·{layout.dp} = {per_step}")
    _validate_pipeline(p, m, t.global_batch_size // per_step, t.compile)
    _require(math.isfinite(t.lr) and t.lr > 0, f"train.lr must be a finite number > 0, got {t.lr}")
    _require(t.steps >= 1, f"train.steps must be >= 1 (optimizer steps to train), got {t.steps}")
    _require(t.head_chunk >= 1, f"train.head_chunk must be >= 1 (tokens per chunk of the fused head), "
             f"got {t.head_chunk}")
    _require(t.max_skipped_steps >= 1, f"train.max_skipped_steps must be >= 1 (non-finite steps skipped in a row, "
             f"or rewinds, before the run stops), got {t.max_skipped_steps}")
    _validate_warmup(cfg.optim, t.steps)
    _require(t.on_nonfinite != "rewind" or cfg.checkpoint.every > 0, "train.on_nonfinite=rewind goes back to the "
             "newest checkpoint: save some with checkpoint.every=N")
    _require(t.eval_every >= 0 and t.eval_batches >= 1, "train.eval_every must be >= 0 and eval_batches >= 1")
    _validate_data(cfg.data, m)
    if p.sequence_parallel:
        _require(cfg.data.seq_len % p.tp == 0, f"parallel.sequence_parallel=true needs "
                 f"data.seq_len={cfg.data.seq_len} divisible by parallel.tp={p.tp}")
    _validate_context_parallel(cfg)
    _validate_tp_overlap(p, cfg.data.seq_len)
    _validate_optim(cfg.optim)
    check_sync(cfg, layout)  # sync.mode's rules and the DP exchange's compression options
    _require(cfg.logging.log_every >= 1, f"logging.log_every must be >= 1, got {cfg.logging.log_every}")
    _validate_checkpoint(cfg.checkpoint)
    _validate_health(cfg.health)
    _validate_run_name(str(cfg.run_name))
    s = list(cfg.profile.steps)
    _require(not s or (len(s) == 2 and 1 <= s[0] <= s[1] <= t.steps),
             f"profile.steps={s} must be [] or [first, last] with 1 <= first <= last <= train.steps={t.steps}")
    return layout


def _validate_context_parallel(cfg: Config) -> None:
    """What parallel.cp > 1 needs: 2·cp chunks of every sequence (split again by TP under sequence parallelism),
    heads to spread over cp under a2a."""
    p, m, seq = cfg.parallel, cfg.model, cfg.data.seq_len
    if p.cp == 1:
        return
    _require(seq % (2 * p.cp) == 0, f"parallel.cp={p.cp} cuts each sequence into 2·cp = {2 * p.cp} chunks: "
             f"data.seq_len={seq} is not divisible by {2 * p.cp}")
    _require(not (p.sequence_parallel and p.tp > 1) or (seq // p.cp) % p.tp == 0, f"parallel.sequence_parallel "
             f"splits each CP rank's {seq // p.cp} tokens over parallel.tp={p.tp}: not divisible")
    heads = m.n_heads // p.tp
    _require(p.cp_comm != "a2a" or heads % p.cp == 0, f"parallel.cp_comm=a2a spreads each TP rank's {heads} "
             f"attention heads over parallel.cp={p.cp}: not divisible (parallel.cp_comm=ring has no such rule)")


def _validate_tp_overlap(p: ParallelConfig, seq: int) -> None:
    """Chunked overlap pipelines the sequence-parallel exchanges: it needs SP at tp > 1, and its pieces (a multiple
    of tp) must divide each CP rank's tokens."""
    chunks = p.tp_overlap_chunks or p.tp
    _require(p.tp_overlap_chunks >= 0, f"parallel.tp_overlap_chunks must be >= 0 (0 = tp), got {p.tp_overlap_chunks}")
    if p.tp_overlap != "chunked" or p.tp == 1:
        return
    _require(p.sequence_parallel, "parallel.tp_overlap=chunked pipelines sequence parallelism's all-gathers and "
             "reduce-scatters with the GEMMs: set parallel.sequence_parallel=true (or use tp_overlap=bulk)")
    _require(chunks % p.tp == 0, f"parallel.tp_overlap_chunks={chunks} must be a multiple of parallel.tp={p.tp} "
             "(each TP rank's share of the sequence cut into equal pieces)")
    _require((seq // p.cp) % chunks == 0, f"parallel.tp_overlap_chunks={chunks} does not divide the "
             f"{seq // p.cp} tokens of each sequence a rank works on (data.seq_len / parallel.cp)")


def _validate_pipeline(p: ParallelConfig, m: ModelConfig, microbatches: int, compiled: bool) -> None:
    """Schedule sizes (interleaving needs pp >= 2 and microbatches divisible by pp), stage_layers, and what a
    zero-bubble schedule needs: a backward it can split (not compiled), zbv equal parts."""
    from hybrid.parallel.pp.pipeline import partition_layers

    spec = SCHEDULES[p.schedule]
    _require(not (spec.split_backward and compiled and p.pp > 1), f"parallel.schedule={p.schedule} splits each "
             "backward into input and weight passes, but train.compile=true makes a compiled graph's backward one node "
             "that cannot be split: set train.compile=false or another schedule")
    parts = p.pp * p.virtual_stages
    _require(p.schedule != "zbv" or p.pp == 1 or p.stage_layers is not None or m.n_layers % parts == 0,
             f"parallel.schedule=zbv needs equal parts: model.n_layers={m.n_layers} is not divisible by "
             f"pp·virtual_stages = {parts} (or set parallel.stage_layers)")
    _require(p.virtual_stages >= spec.min_virtual_stages, f"parallel.schedule={p.schedule} needs "
             f"parallel.virtual_stages >= {spec.min_virtual_stages} ({spec.fewer_virtual})")
    if p.pp > 1 or p.virtual_stages > 1:
        try:
            check_sizes(p.schedule, p.pp, microbatches, p.virtual_stages)
        except ScheduleError as e:
            raise ConfigError(f"parallel.schedule={p.schedule}: {e}") from None
    _require(p.stage_layers in (None, "auto") or _is_int_list(p.stage_layers), "parallel.stage_layers must be "
             f"auto or a list of layer counts like [3,3], got {p.stage_layers!r}")
    if p.stage_layers not in (None, "auto"):
        try:
            partition_layers(m.n_layers, p.pp * p.virtual_stages, p.stage_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _is_int_list(value: object) -> bool:
    return isinstance(value, (list, ListConfig)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _validate_optim(o: OptimConfig) -> None:
    """AdamW's hyperparameters and the schedule's: each inside the range where it means something."""
    for key in ("beta1", "beta2"):
        _require(0.0 <= getattr(o, key) < 1.0, f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    _require(o.eps > 0, f"optim.eps must be > 0, got {o.eps}")
    _require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _require(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1] (the cosine's floor as a share "
             f"of train.lr), got {o.min_lr_ratio}")
    _require(o.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {o.grad_clip}")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _require(0.0 <= o.momentum < 1.0, f"optim.momentum must be in [0, 1), got {o.momentum}")
    _require(not o.nesterov or o.momentum > 0, "optim.nesterov=true needs optim.momentum > 0")
    for key in ("beta1", "beta2", "eps", "weight_decay", "min_lr_ratio", "grad_clip", "momentum"):
        _require(math.isfinite(getattr(o, key)), f"optim.{key} must be finite, got {getattr(o, key)}")


def _validate_warmup(o: OptimConfig, steps: int) -> None:
    """A warmup longer than the run never reaches train.lr. The default warmup is not checked: a short trial
    run (train.steps=3) keeps it rather than refusing to start."""
    _require(o.warmup_steps <= steps or o.warmup_steps == OptimConfig.warmup_steps,
             f"optim.warmup_steps={o.warmup_steps} is longer than the run (train.steps={steps}): the LR would "
             "never reach train.lr; shorten the warmup or raise train.steps")


def _validate_compression(c: CompressionConfig) -> None:
    """The compression package's own check, its CompressionError reported as bad input."""
    from hybrid.compression import CompressionError
    from hybrid.compression.registry import check

    try:
        check(c)
    except CompressionError as e:
        raise ConfigError(str(e)) from None


def _validate_checkpoint(c: CheckpointConfig) -> None:
    from hybrid.checkpoint.preempt import parse_signals

    parse_signals(c.save_on_signal)  # a name that is no catchable signal: ConfigError
    _require(c.every >= 0, f"checkpoint.every must be >= 0 (0 disables saving), got {c.every}")
    _require(c.keep >= 0, f"checkpoint.keep must be >= 0 (0 keeps all), got {c.keep}")
    _require(bool(str(c.resume).strip()), "checkpoint.resume must be none, auto or a checkpoint path")
    _require(bool(str(c.dir).strip()), "checkpoint.dir must not be empty")


def _validate_run_name(name: str) -> None:
    """run_name names one folder inside checkpoint.dir (and runs/): it must not climb out of it."""
    _require(bool(name.strip()) and name not in (".", "..") and not any(c in name for c in "/\\\0"),
             f"run_name={name!r} must be one folder name (no '/', '\\', '..'): it names a folder inside "
             "checkpoint.dir and runs/")


def _validate_model(m: ModelConfig, tp: int) -> None:
    from hybrid.model.family import family_of

    for key in ("n_layers", "hidden", "n_heads", "max_seq_len", "make_vocab_size_divisible_by"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1, got {getattr(m, key)}")
    for key in ("n_kv_heads", "ffn_hidden"):  # null means the default; 0 or less is not a size
        _require(getattr(m, key) is None or getattr(m, key) >= 1,
                 f"model.{key} must be >= 1 (or null for the default), got {getattr(m, key)}")
    for key in ("norm_eps", "init_std", "rope_theta"):
        value = getattr(m, key)
        _require(math.isfinite(value) and value > 0, f"model.{key} must be a finite number > 0, got {value}")
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
        _require(not OmegaConf.is_missing(d, key) or (key == "path" and d.dataset is not None),
                 f"data.{key} is required by data={d.name} (set data.{key}=...)")
    _require(d.seq_len >= 1, f"data.seq_len must be >= 1, got {d.seq_len}")
    with _model_input():
        family_of(m).check_seq_len(m, d.seq_len)
    path = None if OmegaConf.is_missing(d, "path") else d.path
    if path is not None:
        _require(os.path.exists(path), f"data.path={path} does not exist")
    if d.tokenizer is not None:
        _require(os.path.isdir(d.tokenizer), f"data.tokenizer={d.tokenizer} is not a directory")
    _require(d.vocab_size >= 256 + 1, f"data.vocab_size must be > 256 (byte-level BPE), got {d.vocab_size}")
    _require(0.0 < d.eval_fraction < 1.0, f"data.eval_fraction must be in (0, 1), got {d.eval_fraction}")
    _validate_data_source(d, path, m)


def _validate_data_source(d: DataConfig, path: Optional[str], m: ModelConfig) -> None:
    """The combinations of data.path / dataset / streaming / token files that mean something."""
    tokens_in = path is not None and Path(path).suffix.lower() in (".bin", ".npy")
    has_tokenizer = d.tokenizer is not None or (m.init_from is not None and any(
        (Path(m.init_from) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")))
    for key in ("num_proc", "max_chars", "max_tokens"):
        value = getattr(d, key)
        _require(value is None or value >= 1, f"data.{key} must be >= 1 or null, got {value}")
    _require(d.dataset is None or path is None, f"set data.path={path} or data.dataset={d.dataset}, not both")
    _require(not d.streaming or d.dataset is not None, "data.streaming=true needs data.dataset=<hub dataset name>")
    _require(not d.streaming or d.online, f"data.streaming=true reads data.dataset={d.dataset} from the hub: "
             "set data.online=true, or drop streaming to read the local cache")
    _require(not d.streaming or d.max_chars is not None or (has_tokenizer and d.max_tokens is not None),
             "data.streaming=true needs a bound: data.max_chars (or data.max_tokens with a data.tokenizer)")
    _require(d.token_dtype in (None, "uint16", "uint32", "int32"),
             f"data.token_dtype={d.token_dtype} is not one of uint16, uint32, int32")
    _require(d.token_dtype is None or (path is not None and Path(path).suffix.lower() == ".bin"),
             f"data.token_dtype={d.token_dtype} applies to a .bin token file only (data.path={path})")
    _require(not tokens_in or has_tokenizer or m.vocab_size is not None,
             f"data.path={path} holds token ids: set model.vocab_size (or data.tokenizer) to size the model")
