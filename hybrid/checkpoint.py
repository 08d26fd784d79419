"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): save, find, resume (also under
another layout), keep the newest k.

One folder per step, `<checkpoint.dir>/<run name>/step_0000100/`:

    hybrid.json          the manifest, written first by rank 0: step, consumed samples, layout,
                         vocabulary, the resolved config
    tokenizer/           the run's tokenizer (rank 0), so that export needs nothing else
    __<rank>_<i>.distcp  each rank's own shards (DCP; a replicated tensor is written by one rank)
    .metadata            DCP's index of every shard, written last, by rank 0, through a rename

A checkpoint is complete exactly when `.metadata` exists: a crash mid-save leaves a folder
without it, which `checkpoint.resume=auto` skips with a warning (and the next cleanup removes).
What the state dict holds, and how it is resharded, is in `hybrid.checkpoint_state`.

Collectives: a save runs DCP's plan gather/scatter and its final gather to rank 0 over the
world (a dedicated gloo group for async saves, whose collectives run in a background thread);
a load runs DCP's plan exchange; choosing the checkpoint to resume is one broadcast from rank 0.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint_state import (
    Piece,
    ReshardingLoadPlanner,
    StateMismatch,
    blob,
    coord_key,
    derive_rng_state,
    init_optimizer_state,
    model_pieces,
    rng_state,
    set_rng_state,
    to_dcp,
    unblob,
)
from hybrid.config import ConfigError

MANIFEST, METADATA, FORMAT = "hybrid.json", ".metadata", 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
Log = Callable[[str], None]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (missing, partial, corrupt, another model): one line, exit 2."""


def run_root(cfg: Any) -> Path:
    return Path(cfg.checkpoint.dir) / cfg.run_name


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_*` folder under `root`, oldest first, complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete, loadable checkpoint; None when it is. Checks the manifest, DCP's
    index, and that every shard file the index names exists and is as long as the index says."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    if not (path / MANIFEST).is_file():
        return f"is not a hybrid checkpoint ({MANIFEST} is missing)"
    if not (path / METADATA).is_file():
        return f"is incomplete: {METADATA} is missing (the save did not finish)"
    try:
        read_manifest(path)
    except Exception as e:  # noqa: BLE001  (any unreadable manifest is a corrupt checkpoint)
        return f"is corrupt: cannot read its {MANIFEST} ({_first_line(e)})"
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001  (any unreadable index is a corrupt checkpoint)
        return f"is corrupt: cannot read its index {METADATA} ({_first_line(e)})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            return f"is corrupt: shard file {rel} is missing"
        if f.stat().st_size < size:
            return f"is corrupt: shard file {rel} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def find_latest(root: Path, warn: Log) -> Optional[Path]:
    """The newest complete checkpoint under `root`; incomplete or corrupt ones are skipped with a warning."""
    for _, path in reversed(list_steps(root)):
        why = problem(path)
        if why is None:
            return path
        warn(f"warning: checkpoint {path} {why}; skipping it")
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text(encoding="utf-8"))


def model_shape(model_cfg: Any, vocab: int) -> dict[str, Any]:
    """Everything that fixes the shapes of the model's tensors (layout aside): the family's `shape`."""
    from hybrid.model.family import family_of

    return family_of(model_cfg).shape(model_cfg, vocab)


def layout_of(cfg: Any, layout: Any) -> dict[str, Any]:
    """What decides which rank holds which tensors, and its RNG streams (`layout`: the run's Layout)."""
    p = cfg.parallel
    stages = list(p.stage_layers) if p.stage_layers is not None else None
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "virtual_stages": p.virtual_stages,
            "stage_layers": stages}


def layout_name(layout: dict[str, Any]) -> str:
    v = f"v{layout['virtual_stages']}" if layout["virtual_stages"] > 1 else ""
    return f"tp{layout['tp']}pp{layout['pp']}{v}dp{layout['dp']}"


def _hook_key(cfg: Any, layout: Any) -> dict[str, Any]:
    """What the DP hook's state depends on: its method and knobs, the buckets, and the layout."""
    from omegaconf import OmegaConf

    return {"compression": OmegaConf.to_container(cfg.compression, resolve=True), "bucket_mb": cfg.parallel.bucket_mb,
            **layout_of(cfg, layout)}


def check_compatible(manifest: dict[str, Any], cfg: Any, vocab: int, path: Path) -> None:
    """A different model shape is an error naming what differs; a different layout is allowed."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')}, this version reads {FORMAT}")
    saved, here = manifest["model_shape"], model_shape(cfg.model, vocab)
    diff = [f"{k}={saved.get(k)} there, {v} here" for k, v in here.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {path} holds another model shape ({'; '.join(diff)}); "
                              "the model must match (only the layout may change)")


def resolve_resume(cfg: Any, warn: Log) -> Optional[Path]:
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


def plan_resume(cfg: Any, vocab: int, is_writer: bool, warn: Log) -> Optional[tuple[Path, dict[str, Any]]]:
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
            answer[0] = CheckpointError(f"checkpoint.resume={cfg.checkpoint.resume}: {_first_line(e)}")
    if _distributed():
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], CheckpointError):
        raise CheckpointError(str(answer[0]))
    return None if answer[0] is None else (Path(answer[0][0]), answer[0][1])


def load_weights(model: Any, path: Path, mesh: Any = None) -> None:
    """Load only the parameters of checkpoint `path` into `model` (a ModuleList of chunks, any layout;
    `mesh`: the TP device mesh when tp > 1). Export and tools use it; training resumes with `load`."""
    state, copies = _load_state(model_pieces(model, None, True), mesh)
    _dcp_load(state, path)
    for piece in copies:
        piece.local.copy_(_local(state[piece.key]))


def _load_state(all_pieces: list[Piece], mesh: Any) -> tuple[dict[str, Any], list[Piece]]:
    """The DCP state dict to load into, and the pieces whose key appears twice on this rank (the tied
    head and the embedding on one rank): those are loaded once and copied after."""
    state: dict[str, Any] = {}
    copies = []
    for piece in all_pieces:
        if piece.key in state:
            copies.append(piece)
        else:
            state[piece.key] = to_dcp(piece, mesh)
    return state, copies


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """`dcp.load` with the resharding planner; any failure is a CheckpointError naming `path`."""
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), planner=ReshardingLoadPlanner(), no_dist=not _distributed())
    except CheckpointException as e:  # DCP wraps each rank's error (a BaseException): report the first
        failures = [exc for exc, _ in e.failures.values()]
        raise CheckpointError(_load_failure(path, failures[0] if failures else e)) from None
    except Exception as e:
        raise CheckpointError(_load_failure(path, e)) from None


def _load_failure(path: Path, e: BaseException) -> str:
    if isinstance(e, StateMismatch):
        return f"checkpoint {path} does not fit this model: {e}"
    return f"checkpoint {path} could not be read ({_first_line(e)})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _tp_mesh(ctx: Any, device: torch.device) -> Any:
    if ctx.tp_size == 1 or ctx.tp_group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.tp_group, device.type)


class Checkpointer:
    """Saves a Trainer's state every `checkpoint.every` steps (and at the last step), at most one save
    in flight; loads one into a Trainer. Rank 0 writes the manifest and cleans up."""

    def __init__(self, cfg: Any, ctx: Any, device: torch.device, log: Log) -> None:
        c = cfg.checkpoint
        self.cfg, self.ctx, self.log = cfg, ctx, log
        self.every, self.keep, self.use_async = c.every, c.keep, bool(c["async"])
        self.root = run_root(cfg)
        self.writer = ctx.rank == 0
        self.mesh = _tp_mesh(ctx, device)
        # async saves run DCP's collectives in a background thread: on their own gloo group
        self.group = dist.new_group(backend="gloo") if self.use_async and _distributed() else None
        self.pending: Optional[tuple[Any, Path, float]] = None
        self.stager = Stager()
        self.protected: set[Path] = set()  # the checkpoint this run resumed from

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.cfg.train.steps)

    def after_step(self, trainer: Any) -> None:
        """Finish a completed async save; start a save if this step is due."""
        if self.pending is not None and self.pending[0].done():
            self.wait()
        if self.due(trainer.step):
            self.save(trainer)

    def save(self, trainer: Any) -> Path:
        """Save `trainer` at its current step (waits for a save still in flight first)."""
        self.wait()
        path = step_path(self.root, trainer.step)
        state = self.state_dict(trainer)
        self._prepare(path, trainer)
        start = time.perf_counter()
        if self.use_async:
            future = dcp.async_save(self.stager.stage(state), checkpoint_id=str(path), process_group=self.group,
                                    async_stager=_Staged())
            self.pending = (future, path, start)
        else:
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())
            self._finish(path, start)
        return path

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, then clean up."""
        if self.pending is None:
            return
        future, path, start = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise RuntimeError(f"checkpoint save to {path} failed: {_first_line(e)}") from e
        self._finish(path, start)

    def state_dict(self, trainer: Any) -> dict[str, Any]:
        """This rank's part of the checkpoint (tensors are views of the live state: save copies them)."""
        init_optimizer_state(trainer.optimizer)
        state = {p.key: to_dcp(p, self.mesh) for p in model_pieces(trainer.model, trainer.optimizer, False)}
        c = self.ctx.coord
        state[coord_key("rng", c.pp, c.dp, c.tp)] = blob(rng_state(trainer.model))
        hook = trainer.grad_sync.state
        state[coord_key("hook", c.pp, c.dp, c.tp)] = blob(hook.state_dict() if hasattr(hook, "state_dict") else {})
        return state

    def _manifest(self, trainer: Any) -> dict[str, Any]:
        from omegaconf import OmegaConf

        cfg = self.cfg
        layout = self.ctx.layout
        return {"format": FORMAT, "step": trainer.step, "consumed_samples": trainer.sampler.consumed_samples,
                "data_seed": trainer.sampler.seed, "model_shape": model_shape(cfg.model, trainer.model[0].vocab_size),
                "layout": layout_of(cfg, layout), "hook_key": _hook_key(cfg, layout), "time": time.time(),
                "torch": torch.__version__, "config": OmegaConf.to_container(cfg, resolve=True)}

    def _prepare(self, path: Path, trainer: Any) -> None:
        """Rank 0 replaces any earlier folder of this step, writes the manifest and the tokenizer;
        everyone waits for it before DCP writes a byte."""
        if self.writer:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
            (path / MANIFEST).write_text(json.dumps(self._manifest(trainer), indent=1) + "\n", encoding="utf-8")
            tokenizer = getattr(trainer.corpus, "tokenizer", None)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(path / "tokenizer"))
        if _distributed():
            dist.barrier(group=self.group)

    def _finish(self, path: Path, start: float) -> None:
        if not self.writer:
            return
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        self.log(f"checkpoint: saved {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.2f} s"
                 f"{', async' if self.use_async else ''})")
        _point_latest(self.root, path)
        self.cleanup()

    def cleanup(self) -> None:
        """Keep the newest `keep` complete checkpoints (0: all) and the one resumed from; remove older
        complete ones and incomplete ones older than the newest complete. Nothing is in flight here."""
        steps = [(s, p.resolve()) for s, p in list_steps(self.root)]
        complete = [p for _, p in steps if (p / METADATA).is_file()]
        if not complete:
            return
        kept = set(complete[-self.keep:] if self.keep > 0 else complete) | {p.resolve() for p in self.protected}
        newest = max(s for s, p in steps if p == complete[-1])
        for step, p in steps:
            stale = p not in kept and (p in complete or step < newest)
            if stale:
                shutil.rmtree(p, ignore_errors=True)
                self.log(f"checkpoint: removed {p}")

    def load(self, trainer: Any, path: Path, manifest: dict[str, Any]) -> None:
        """Load `path` into `trainer`: parameters and optimizer state resharded to this layout, step and
        data position; RNG streams and hook state restored under the same layout, else derived/dropped."""
        cfg, c = self.cfg, self.ctx.coord
        init_optimizer_state(trainer.optimizer)
        state, copies = _load_state(model_pieces(trainer.model, trainer.optimizer, True), self.mesh)
        here = layout_of(cfg, self.ctx.layout)
        same_layout = manifest["layout"] == here
        same_hook = manifest["hook_key"] == _hook_key(cfg, self.ctx.layout)
        rng_key, hook_key = coord_key("rng", c.pp, c.dp, c.tp), coord_key("hook", c.pp, c.dp, c.tp)
        if same_layout:
            state[rng_key] = b""
        if same_hook:
            state[hook_key] = b""
        _dcp_load(state, path)
        for piece in copies:
            piece.local.copy_(_local(state[piece.key]))
        self._restore_rest(trainer, state, manifest, rng_key if same_layout else None,
                           hook_key if same_hook else None)
        self.protected.add(path)
        if self.writer:
            self.log(_resume_line(path, manifest, here, same_hook))
            changed = config_changes(manifest.get("config", {}), cfg)
            if changed:
                self.log("checkpoint: config changed since the save: " + "; ".join(changed))

    def _restore_rest(self, trainer: Any, state: dict[str, Any], manifest: dict[str, Any],
                      rng_key: Optional[str], hook_key: Optional[str]) -> None:
        step = int(manifest["step"])
        trainer.step = step
        trainer.sampler.load_state_dict({"consumed_samples": manifest["consumed_samples"],
                                         "seed": manifest["data_seed"]})
        if rng_key is not None:
            set_rng_state(trainer.model, unblob(state[rng_key]))
        else:
            derive_rng_state(trainer.model, self.cfg.train.seed, step, self.ctx.pp_rank)
        hook = trainer.grad_sync.state
        if hook_key is not None:
            if hasattr(hook, "load_state_dict"):
                hook.load_state_dict(unblob(state[hook_key]))
        elif hasattr(hook, "iteration"):
            hook.iteration = step  # the warm-up still counts from the run's first step


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def config_changes(saved: dict[str, Any], cfg: Any, limit: int = 12) -> list[str]:
    """`key: old → new` for every config value that differs from the saved run's, except the layout,
    checkpoint and logging keys (a resumed run is expected to change those)."""
    from omegaconf import OmegaConf

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    old, new = flat(saved), flat(OmegaConf.to_container(cfg, resolve=True))
    skip = ("parallel.", "checkpoint.", "logging.", "run_name")
    keys = [k for k in sorted(old.keys() | new.keys()) if not k.startswith(skip) and old.get(k) != new.get(k)]
    lines = [f"{k}: {old.get(k)} → {new.get(k)}" for k in keys[:limit]]
    return lines + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def _point_latest(root: Path, path: Path) -> None:
    """`<root>/latest` → the newest complete checkpoint (a relative symlink, swapped in by rename)."""
    tmp = root / ".latest.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    tmp.replace(root / "latest")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class Stager:
    """The blocking part of an async save: copy every tensor of the state into CPU buffers that are kept
    from one save to the next (one save is in flight at a time, so a buffer is free again when the next
    save stages). Reusing them is ~9× faster than the first save's fresh allocations (measured with
    gpt-125m at tp2pp2dp2: 0.22 s vs 2.06 s). A DTensor's local shard becomes a DTensor over its buffer.
    Every rank stages its whole state, DP replicas included (DCP drops duplicates only when it plans
    the write), so the buffers hold about 2× the checkpoint at dp=2."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return buf.copy_(t)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out: dict[str, Any] = {}
        for key, v in state.items():
            if isinstance(v, DTensor):
                out[key] = DTensor.from_local(self._buffer(key, v.to_local()), v.device_mesh, v.placements,
                                              run_check=False, shape=v.shape, stride=v.stride())
            elif isinstance(v, torch.Tensor):
                out[key] = self._buffer(key, v)
            else:
                out[key] = v  # bytes: immutable
        return out


class _Staged:
    """DCP's async stager protocol for a state `Stager` has already copied: nothing left to do."""

    should_synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


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
