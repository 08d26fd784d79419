"""Choosing what to resume and checking that it fits: `checkpoint.resume` (none | auto | a path) to
one checkpoint, the model shape it must share with this run, the layout and DP-hook keys that decide
whether per-rank state (RNG streams, hook state) carries over, and what a resume logs.

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
from hybrid.model.family import family_of

if TYPE_CHECKING:
    from hybrid.config import Config, ModelConfig
    from hybrid.parallel.context import Layout


def model_shape(model_cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """Everything that fixes the shapes of the model's tensors (layout aside): the family's `shape`."""
    return family_of(model_cfg).shape(model_cfg, vocab)


def layout_of(cfg: Config, layout: Layout) -> dict[str, Any]:
    """What decides which rank holds which tensors, and its RNG streams (`layout`: the run's Layout)."""
    p = cfg.parallel
    stages = list(p.stage_layers) if p.stage_layers is not None else None
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "virtual_stages": p.virtual_stages,
            "stage_layers": stages}


def layout_name(layout: dict[str, Any]) -> str:
    v = f"v{layout['virtual_stages']}" if layout["virtual_stages"] > 1 else ""
    return f"tp{layout['tp']}pp{layout['pp']}{v}dp{layout['dp']}"


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


def config_changes(saved: dict[str, Any], cfg: Config, limit: int = 12) -> list[str]:
    """`key: old → new` for every config value that differs from the saved run's, except the layout,
    checkpoint, logging and profile keys (a resumed run is expected to change those)."""
    from omegaconf import OmegaConf

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    old, new = flat(saved), flat(OmegaConf.to_container(cfg, resolve=True))
    skip = ("parallel.", "checkpoint.", "logging.", "profile.", "run_name")
    keys = [k for k in sorted(old.keys() | new.keys()) if not k.startswith(skip) and old.get(k) != new.get(k)]
    lines = [f"{k}: {old.get(k)} → {new.get(k)}" for k in keys[:limit]]
    return lines + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


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
