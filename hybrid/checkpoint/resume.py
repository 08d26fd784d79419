"""Choosing what to resume and checking that it fits: `checkpoint.resume` (none | auto | a path) to
one checkpoint, the model shape it must share with this run, the training settings it must share
unless `checkpoint.allow_changes` (`refuse_changes`), whether anything is left to train
(`finished_line`), the layout and DP-hook keys that decide whether per-rank state (RNG streams, hook
state) carries over, and what a resume logs; without a checkpoint, the start from `model.init_from` (`pretrained`).

Collective: `plan_resume` is one broadcast from rank 0 over the world; the rest is local.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from hybrid.checkpoint.files import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    Log,
    distributed,
    find_latest,
    first_line,
    list_steps,
    problem,
    read_manifest,
    run_root,
)
from hybrid.config import FORMERLY, METHOD_KNOBS, ConfigError
from hybrid.model.family import ModelConfigError, family_of

if TYPE_CHECKING:
    from torch import nn

    from hybrid.config import Config, ModelConfig
    from hybrid.parallel.context import Layout


def model_shape(model_cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """Everything that fixes the shapes of the model's tensors (layout aside): the family's `shape`."""
    return family_of(model_cfg).shape(model_cfg, vocab)


def layout_of(cfg: Config, layout: Layout) -> dict[str, Any]:
    """What decides which rank holds which tensors, and its RNG streams (`layout`: the run's Layout)."""
    p = cfg.parallel
    stages = list(p.stage_layers) if p.stage_layers is not None else None
    cp = {"cp": layout.cp} if layout.cp > 1 else {}  # absent at cp=1: the manifests written before CP match
    return {"tp": layout.tp, **cp, "pp": layout.pp, "dp": layout.dp, "virtual_stages": p.virtual_stages,
            "stage_layers": stages}


def layout_name(layout: dict[str, Any]) -> str:
    v = f"v{layout['virtual_stages']}" if layout["virtual_stages"] > 1 else ""
    cp = f"cp{layout['cp']}" if layout.get("cp", 1) > 1 else ""
    return f"tp{layout['tp']}{cp}pp{layout['pp']}{v}dp{layout['dp']}"


def hook_key(cfg: Config, layout: Layout) -> dict[str, Any]:
    """What the DP hook's state depends on: its method and knobs, the buckets, and the layout."""
    from omegaconf import OmegaConf

    return {"compression": OmegaConf.to_container(cfg.compression, resolve=True), "bucket_mb": cfg.parallel.bucket_mb,
            **layout_of(cfg, layout)}


def check_compatible(manifest: dict[str, Any], cfg: Config, vocab: int, path: Path) -> None:
    """A different model shape is an error naming what differs; a different layout is allowed."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')}, this version reads {FORMAT}")
    saved, here = manifest["model_shape"], model_shape(cfg.model, vocab)
    diff = [f"{k}={saved.get(k)} there, {v} here" for k, v in here.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {path} holds another model shape ({'; '.join(diff)}); "
                              "the model must match (only the layout may change)")


def resolve_resume(cfg: Config, warn: Log) -> Optional[Path]:
    """The checkpoint `checkpoint.resume` names: none → None; auto → the newest complete one of this
    run (None if there is none); a path → that checkpoint, or the newest complete one in that folder."""
    r = str(cfg.checkpoint.resume)
    if r == "none":
        return None
    if r == "auto":
        return find_latest(run_root(cfg), warn)
    path = Path(r)
    if path.is_dir() and not (path / MANIFEST).exists() and list_steps(path):
        latest = find_latest(path, warn)
        if latest is None:
            raise CheckpointError(f"checkpoint.resume: no complete checkpoint in {path}")
        return latest
    why = problem(path)
    if why is not None:
        raise CheckpointError(f"checkpoint.resume: {path} {why}")
    return path


def plan_resume(cfg: Config, vocab: int, is_writer: bool, warn: Log) -> Optional[tuple[Path, dict[str, Any]]]:
    """Rank 0 picks the checkpoint (and checks it fits this model); every rank gets the same answer or
    the same error. One `broadcast_object_list` over the world."""
    answer: list[Any] = [None]
    if is_writer:
        try:
            path = resolve_resume(cfg, warn)
            if path is not None:
                manifest = read_manifest(path)
                check_compatible(manifest, cfg, vocab, path)
                refuse_changes(manifest, cfg, path)
                answer[0] = (str(path), manifest)
        except CheckpointError as e:
            answer[0] = e
        except Exception as e:  # noqa: BLE001  (anything else unreadable: still one answer for every rank)
            answer[0] = CheckpointError(f"checkpoint.resume={cfg.checkpoint.resume}: {first_line(e)}")
    if distributed():
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], CheckpointError):
        raise CheckpointError(str(answer[0]))
    return None if answer[0] is None else (Path(answer[0][0]), answer[0][1])


# What a resume may change without changing where training goes: the layout (resharded), where files go,
# what is logged and profiled, how long it trains (extending a run), evals, the device, activation
# recomputation, compilation, the fused head and AdamW's kernels (the same updates), labels, a start point a resume
# ignores, a metric-only knob, and what a non-finite step makes the run do. Any other difference (train.lr,
# seed, batch sizes, precision, optim.* (its name too: adamw or sgd), model.*, data.*, compression.*, sync.*)
# is a training setting: a resume refuses it unless checkpoint.allow_changes=true.
FREE_PREFIXES = ("run_name", "parallel.", "checkpoint.", "logging.", "profile.")
FREE_KEYS = frozenset({"train.steps", "train.device", "train.eval_every", "train.eval_batches", "train.recompute",
                       "train.on_nonfinite", "train.max_skipped_steps",
                       "train.compile", "train.compile_scope", "train.compile_mode", "train.fused_head",
                       "train.head_chunk", "optim.implementation", "model.name", "model.init_from", "data.name",
                       "data.cache_dir", "sync.name", "compression.measure_error", "compression.measure_every"})


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def changed_values(saved: dict[str, Any], cfg: Config, both: bool = False) -> dict[str, tuple[Any, Any]]:
    """Dotted key → (saved value, value now) for every config value that differs from the saved run's; a
    key only one side has counts with None on the other, or (`both`) not at all."""
    from omegaconf import OmegaConf

    old, new = _flat(saved), _flat(OmegaConf.to_container(cfg, resolve=True))
    keys = old.keys() & new.keys() if both else old.keys() | new.keys()
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


def _lines(changes: dict[str, tuple[Any, Any]], limit: int) -> list[str]:
    lines = [f"{k}: {old} → {new}" for k, (old, new) in list(changes.items())[:limit]]
    return lines + ([f"and {len(changes) - limit} more"] if len(changes) > limit else [])


def config_changes(saved: dict[str, Any], cfg: Config, limit: int = 12) -> list[str]:
    """`key: old → new` for every config value that differs from the saved run's, except the layout,
    checkpoint, logging and profile keys (a resumed run is expected to change those)."""
    skip = ("parallel.", "checkpoint.", "logging.", "profile.", "run_name")
    return _lines({k: v for k, v in changed_values(saved, cfg).items() if not k.startswith(skip)}, limit)


def training_changes(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """The changed training settings: keys outside FREE_PREFIXES and FREE_KEYS. Only keys both configs
    have: one that the saved config lacks comes from an older hybrid, which behaved as its default (or as
    `FORMERLY` says, where the default is new: PowerSGD's fp32 factors). A knob only
    some methods read (`METHOD_KNOBS`: top-k's density, 0.01 by default in older hybrids and now sized from the
    run; DGC's momentum, 0.9 then and 0 now) counts only where either run's method reads it."""
    changes = {k: v for k, v in changed_values(_as_it_ran(saved), cfg, both=True).items()
               if not k.startswith(FREE_PREFIXES) and k not in FREE_KEYS}
    methods = {saved.get("compression", {}).get(k) for k in ("method", "inner")} | {cfg.compression.method,
                                                                                       cfg.compression.inner}
    for knob, readers in METHOD_KNOBS.items():
        if not methods & readers:
            changes.pop(f"compression.{knob}", None)
    return changes


def _as_it_ran(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config with the `compression` knobs it lacks but ran otherwise than today's default (`FORMERLY`)."""
    if "compression" not in saved:
        return saved
    return {**saved, "compression": {**FORMERLY, **saved["compression"]}}


def refuse_changes(manifest: dict[str, Any], cfg: Config, path: Path) -> None:
    """A resume continues the checkpoint's run: other training settings are refused (CheckpointError, one
    line naming them) unless `checkpoint.allow_changes` is true."""
    changes = training_changes(manifest.get("config", {}), cfg)
    if changes and not cfg.checkpoint.allow_changes:
        raise CheckpointError(f"checkpoint {path} was trained with other settings ({'; '.join(_lines(changes, 12))}); "
                              "checkpoint.allow_changes=true resumes it with the new values, "
                              "checkpoint.resume=none or another run_name starts a fresh run")


def finished_line(path: Path, manifest: dict[str, Any], cfg: Config) -> Optional[str]:
    """The one line of a run with nothing left to train (its checkpoint is at train.steps, or past it), else None."""
    step, steps = int(manifest["step"]), cfg.train.steps
    if step < steps:
        return None
    where = "= train.steps" if step == steps else f"> train.steps={steps}"
    return (f"nothing to do: {path} is at step {step} {where}; raise train.steps to train longer, "
            "or checkpoint.resume=none / another run_name to start fresh")


def resume_lines(path: Path, manifest: dict[str, Any], cfg: Config, here: dict[str, Any], same_hook: bool) -> list[str]:
    """What rank 0 logs after a resume: what was loaded and what changed (layout, dropped hook state,
    config values)."""
    changed = config_changes(manifest.get("config", {}), cfg)
    changes = ["checkpoint: config changed since the save: " + "; ".join(changed)] if changed else []
    return [_resume_line(path, manifest, here, same_hook), *changes]


def _resume_line(path: Path, manifest: dict[str, Any], here: dict[str, Any], same_hook: bool) -> str:
    line = f"checkpoint: resumed {path} at step {manifest['step']} ({manifest['consumed_samples']} samples consumed)"
    saved = manifest["layout"]
    if saved != here:
        line += (f"; layout changed {layout_name(saved)} → {layout_name(here)}: parameters and optimizer state "
                 "resharded, RNG streams derived from (seed, step, coordinates)")
    saved_method = manifest["hook_key"]["compression"]["method"]
    if not same_hook and saved_method != "none":
        line += "; warning: compression state (error-feedback residuals, PowerSGD factors) dropped"
    return line


def pretrained(model: nn.ModuleList, model_cfg: ModelConfig) -> str:
    """Fill the chunks from the transformers folder `model.init_from` (no collective); a folder that
    does not fit the model is bad input (the model package's ModelConfigError becomes a ConfigError)."""
    from hybrid.model.hf import load_pretrained

    try:
        return load_pretrained(model, model_cfg.init_from, model_cfg, model[0].vocab_size)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
