"""The Checkpointer: saves the states it is given every `checkpoint.every` steps (and at the last
step), at most one save in flight, keeps the newest k, and loads a checkpoint back into them.

It is handed what it saves, by name (as torchtitan's `CheckpointManager(states=...)`):

- `model`: the rank's model chunks (an `nn.ModuleList`) and `optimizer`: its AdamW. Saved as the
  layout-independent sharded keys of `hybrid.checkpoint.state`, with the rank's RNG streams (torch's
  default generators and each chunk's TP stream), restored only under the same layout.
- `trainer`: the run's position, the same on every rank (`state_dict()` with at least `step`, which
  names the folder): written into the manifest by rank 0 and read back from it.
- `hook` (optional): the DP compression hook's state (`state_dict()` / `load_state_dict()`), per
  rank, restored only when the compression method, its knobs, the buckets and the layout are the
  same; otherwise dropped (and its step count set to the resumed step).

Collectives: a save runs DCP's plan gather/scatter and its final gather to rank 0 over the world (a
dedicated gloo group for async saves, whose collectives run in a background thread) after one
barrier; a load runs DCP's plan exchange.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint.files import (
    FORMAT,
    Log,
    NonFiniteState,
    distributed,
    first_line,
    point_latest,
    run_root,
    scan,
    single_process_quiet,
    stale,
    step_path,
    write_manifest,
)
from hybrid.checkpoint.preempt import Preemption
from hybrid.checkpoint.resume import hook_key, layout_of, model_shape, resume_lines
from hybrid.checkpoint.stager import Staged, Stager
from hybrid.checkpoint.state import (
    blob,
    derive_rng_state,
    fill_copies,
    first_nonfinite,
    init_optimizer_state,
    load_target,
    model_pieces,
    read_state,
    rng_state,
    set_rng_state,
    to_dcp,
    unblob,
)
from hybrid.checkpoint.trust import remove_step

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hybrid.config import Config
    from hybrid.parallel.context import ParallelContext


def _quiet(_: str) -> None:
    pass


def _save_group(cfg: Config) -> dist.ProcessGroup:
    """The async saves' own gloo group over the world, with `parallel.timeout_s` (a bench's config may lack it)."""
    from hybrid.parallel.collectives import name_group
    from hybrid.parallel.timeouts import timeout_of

    group = dist.new_group(backend="gloo", timeout=timeout_of(getattr(cfg.parallel, "timeout_s", None)),
                           group_desc="checkpoint")
    name_group(group, "checkpoint")
    return group


def _tp_mesh(ctx: ParallelContext, device: torch.device) -> Optional[DeviceMesh]:
    if ctx.tp_size == 1 or ctx.tp_group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.tp_group, device.type)


class Checkpointer:
    """Saves `states` (see the module docstring) every `checkpoint.every` steps and loads a checkpoint
    into them. Rank 0 writes the manifest, logs through `log` and cleans up."""

    def __init__(self, cfg: Config, ctx: ParallelContext, device: torch.device, states: Mapping[str, Any],
                 tokenizer: Any = None, log: Log = _quiet) -> None:
        c = cfg.checkpoint
        self.cfg, self.ctx, self.states, self.tokenizer, self.log = cfg, ctx, states, tokenizer, log
        self.every, self.keep, self.use_async = c.every, c.keep, bool(getattr(c, "async"))
        self.root = run_root(cfg)
        self.writer = ctx.rank == 0
        self.mesh = _tp_mesh(ctx, device)
        self.device = device  # the world group's collectives run there (NCCL: CUDA tensors)
        # async saves run DCP's collectives in a background thread: on their own gloo group
        self.group = _save_group(cfg) if self.use_async and distributed() else None
        self.pending: Optional[tuple[Any, Path, float]] = None
        self.stager = Stager()
        self.protected: set[Path] = set()  # the checkpoint this run resumed from
        self.saved_step: Optional[int] = None  # the step of the last save started
        # checkpoint.save_on_signal (a config without the key, as a bench's, saves on no signal)
        self.preemption = Preemption(getattr(c, "save_on_signal", ()), device)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.cfg.train.steps)

    def after_step(self, step: int) -> None:
        """Finish a completed async save; start a save if step `step` is due."""
        if self.pending is not None and self.pending[0].done():
            self.wait()
        if self.due(step):
            self.save()

    def save(self) -> Path:
        """Save the states at the trainer's current step (waits for a save still in flight first)."""
        self.wait()
        run = self.states["trainer"].state_dict()
        path = step_path(self.root, run["step"])
        self.saved_step = run["step"]
        self.refuse_nonfinite(run["step"])
        state = self.state_dict()
        self._prepare(path, run)
        start = time.perf_counter()
        if self.use_async:
            future = dcp.async_save(self.stager.stage(state), checkpoint_id=str(path), process_group=self.group,
                                    async_stager=Staged())
            self.pending = (future, path, start)
        else:
            with single_process_quiet():
                dcp.save(state, checkpoint_id=str(path), no_dist=not distributed())
            self._finish(path, start)
        return path

    def save_on_signal(self, step: int) -> Optional[str]:
        """At a step boundary: if any rank caught a `checkpoint.save_on_signal` signal (`Preemption.agreed`:
        one all_reduce over the world), save step `step` (unless this step's save already started), wait
        until it is complete, log it and return the signal's name; else None."""
        sig = self.preemption.agreed()
        if sig is None:
            return None
        if self.saved_step != step:
            self.save()
        self.wait()
        if self.writer:
            self.log(f"checkpoint: saved step {step} on {sig.name}; exiting (resume with checkpoint.resume=auto)")
        return sig.name

    def refuse_nonfinite(self, step: int) -> None:
        """Raise NonFiniteState on every rank when any rank's parameters or AdamW moments hold a NaN or an
        inf: such a state is never written, and no finite checkpoint is removed for it. Collectives: one
        all_reduce (MIN) over the world of the first rank with such a tensor, then, when there is one, a
        broadcast of that tensor's global name from it."""
        init_optimizer_state(self.states["optimizer"])
        name = first_nonfinite(model_pieces(self.states["model"], self.states["optimizer"], False))
        world = dist.get_world_size() if distributed() else 1
        first = torch.tensor([self.ctx.rank if name is not None else world], device=self.device)
        if distributed():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            box = [name]
            if int(first) < world:
                dist.broadcast_object_list(box, src=int(first))
            name = box[0]
        if int(first) < world:
            latest = self.root / "latest"
            kept = latest.resolve() if latest.exists() else "none was saved"
            raise NonFiniteState(f"step {step} was not checkpointed: {name} is not finite (NaN or inf) on rank "
                                 f"{int(first)}; the last finite checkpoint ({kept}) is kept and nothing was removed")

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, then clean up."""
        if self.pending is None:
            return
        future, path, start = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise RuntimeError(f"checkpoint save to {path} failed: {first_line(e)}") from e
        self._finish(path, start)

    def _coord_keys(self) -> tuple[str, str]:
        """This rank's RNG and hook blob keys."""
        return self.ctx.coord.key("rng"), self.ctx.coord.key("hook")

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint (tensors are views of the live state: save copies them)."""
        model, optimizer = self.states["model"], self.states["optimizer"]
        init_optimizer_state(optimizer)
        state = {p.key: to_dcp(p, self.mesh) for p in model_pieces(model, optimizer, False)}
        rng_key, hook_blob_key = self._coord_keys()
        state[rng_key] = blob(rng_state(model))
        if self.states.get("sync") is not None:  # replicas that differ between syncs: each its own (`hybrid.sync`);
            state[self._sync_key()] = blob(self.states["sync"].state_dict())  # first: it waits for exchanges in flight
        hook = self.states.get("hook")
        state[hook_blob_key] = blob(hook.state_dict() if hasattr(hook, "state_dict") else {})
        return state

    def _sync_key(self) -> str:
        return self.ctx.coord.key("sync")

    def _same_sync(self, manifest: dict[str, Any], same_layout: bool) -> bool:
        """Whether the checkpoint holds this rank's replica state as this run keeps it: the same layout, node size
        and `sync` settings (a label aside)."""
        from omegaconf import OmegaConf

        saved = manifest.get("config", {})
        now = OmegaConf.to_container(self.cfg, resolve=True)
        keep = [(c.get("sync", {}) | {"name": None}, c.get("parallel", {}).get("ranks_per_node")) for c in (saved, now)]
        return same_layout and keep[0] == keep[1]

    def _manifest(self, run: dict[str, Any]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        cfg, layout = self.cfg, self.ctx.layout
        vocab = self.states["model"][0].vocab_size
        return {"format": FORMAT, **run, "model_shape": model_shape(cfg.model, vocab),
                "layout": layout_of(cfg, layout), "hook_key": hook_key(cfg, layout), "time": time.time(),
                "torch": torch.__version__, "config": OmegaConf.to_container(cfg, resolve=True)}

    def _prepare(self, path: Path, run: dict[str, Any]) -> None:
        """Rank 0 replaces any earlier folder of this step (`trust.remove_step`: a symbolic link is unlinked,
        never followed), writes the manifest and the tokenizer; everyone waits for it before DCP writes a
        byte. Collective: a broadcast from rank 0 of its errno (0 when it wrote; in place of a barrier), so that
        a failed write (disk full, permissions) is an OSError on every rank rather than a peer's traceback."""
        error: Optional[OSError] = None
        if self.writer:
            try:
                self._write_head(path, run)
            except OSError as e:
                error = e
        on = self.device if self.group is None else torch.device("cpu")  # the async saves' group is gloo
        code = torch.tensor([0 if error is None else (error.errno or errno.EIO)], device=on)
        if distributed():
            dist.broadcast(code, src=0, group=self.group)
        if error is not None:
            raise error
        if int(code):
            raise OSError(int(code), f"{os.strerror(int(code))} (rank 0, writing {path})")

    def _write_head(self, path: Path, run: dict[str, Any]) -> None:
        why = remove_step(path, self.root)
        if why is not None:
            raise FileExistsError(f"checkpoint: cannot save step {run['step']}: {why}")
        path.mkdir(parents=True)
        write_manifest(path, self._manifest(run))
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(str(path / "tokenizer"))

    def _finish(self, path: Path, start: float) -> None:
        if not self.writer:
            return
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        self.log(f"checkpoint: saved {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.2f} s"
                 f"{', async' if self.use_async else ''})")
        point_latest(self.root, path)
        self.cleanup()

    def cleanup(self) -> None:
        """Remove what keep-k (`files.stale`) says, never the checkpoint resumed from. Nothing is in
        flight here."""
        for p in stale(scan(self.root), self.keep, {p.resolve() for p in self.protected}):
            why = remove_step(p, self.root)
            self.log(f"checkpoint: removed {p}" if why is None else f"warning: checkpoint: kept {p}: {why}")

    def load(self, path: Path, manifest: dict[str, Any]) -> None:
        """Load `path` (with its `manifest`, from `plan_resume`): parameters and optimizer state
        resharded to this layout, the trainer's position; RNG streams and hook state restored under
        the same layout, else derived/dropped. A checkpoint that cannot be read raises CheckpointError."""
        cfg, model, optimizer = self.cfg, self.states["model"], self.states["optimizer"]
        init_optimizer_state(optimizer)
        state, copies = load_target(model_pieces(model, optimizer, True), self.mesh)
        here = layout_of(cfg, self.ctx.layout)
        same_layout = manifest["layout"] == here
        same_hook = manifest["hook_key"] == hook_key(cfg, self.ctx.layout)
        rng_key, hook_blob_key = self._coord_keys()
        if same_layout:
            state[rng_key] = b""
        if same_hook:
            state[hook_blob_key] = b""
        sync = self.states.get("sync")
        same_sync = sync is not None and self._same_sync(manifest, same_layout)
        if same_sync:
            state[self._sync_key()] = b""
        read_state(state, path)
        fill_copies(state, copies)
        optimizer.loaded()  # bf16 parameters: rounded from the loaded main weights (ZeRO-1: all-gathered)
        self._restore_rest(state, manifest, rng_key if same_layout else None, hook_blob_key if same_hook else None)
        if same_sync:  # this replica's own parameters, inner optimizer state, anchors and outer momentum
            sync.load_state_dict(unblob(state[self._sync_key()]))
        elif sync is not None:
            sync.restart(int(manifest["step"]))
            if self.writer:
                self.log(f"note: {path} holds no replica state for this layout and sync mode: every replica "
                         "restarts from the saved parameters (DiLoCo's outer momentum, a server's optimizer state "
                         "from zero)")
        self.protected.add(path)
        if self.writer:
            for line in resume_lines(path, manifest, cfg, here, same_hook):
                self.log(line)

    def _restore_rest(self, state: dict[str, Any], manifest: dict[str, Any], rng_key: Optional[str],
                      hook_blob_key: Optional[str]) -> None:
        run = self.states["trainer"]
        run.load_state_dict({k: manifest[k] for k in run.state_dict() if k in manifest})
        step, model = int(manifest["step"]), self.states["model"]
        if rng_key is not None:
            set_rng_state(model, unblob(state[rng_key]))
        else:
            derive_rng_state(model, self.cfg.train.seed, step, self.ctx.pp_rank, self.ctx.cp_rank)
        hook = self.states.get("hook")
        if hook_blob_key is not None:
            if hasattr(hook, "load_state_dict"):
                hook.load_state_dict(unblob(state[hook_blob_key]))
        elif hasattr(hook, "iteration"):
            hook.iteration = step  # the warm-up still counts from the run's first step
