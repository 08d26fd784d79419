"""The seam of the DP dimension: a registry of sync modes, each building one `DPPlan` for the trainer.

A sync mode (`sync.mode`, registered with `register_sync_mode`) decides how DP replicas agree and what they
exchange. It answers five questions, and nothing else in hybrid asks them:

- `check(cfg, layout)`: its validation rules (one-line `ConfigError`s), before any process group exists;
- `build(cfg, ctx, model, main, hook)`: the run's `DPPlan` — the per-step gradient sync, the optimizer, the
  work after each optimizer step, the checkpoint's states, the run record's figures;
- `footprint(cfg, params, sizes, dp, share, device, host)`: what it holds on a rank, for the memory estimate;
- `startup(cfg, layout)`: its start-up lines (a mode with nothing to do at this layout says so);
- `name`: the `sync.mode` value it answers to.

The trainer holds the plan and calls it at fixed points of the step (`after_step`, `observe`, the records,
the checkpoint's states); it never learns which mode, codec or optimizer it got.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn

from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.data import CommHook, GradSync

if TYPE_CHECKING:
    from hybrid.config import Config
    from hybrid.parallel.context import Layout, ParallelContext
    from hybrid.sync.footprint import Footprint


class ReplicaSync(Protocol):
    """Replica-level work after each optimizer step (DiLoCo's outer step, a gossip round, …), and its state."""

    state: Any  # the compression hook's state it runs (the checkpoint's "hook"), or None

    def after_step(self, step: int, last: bool = False) -> list[int]: ...

    def restart(self, step: int = 0) -> None: ...

    def record(self, steps: int) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class Watcher(Protocol):
    """A per-step observer of the training loss with run-level state (the auto compression schedule)."""

    def observe(self, step: int, loss: Callable[[], float]) -> Optional[str]: ...

    def record(self, step: int) -> dict[str, Any]: ...

    def run_state(self) -> Optional[dict[str, Any]]: ...

    def load_run_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class DPPlan:
    """What the DP dimension gives one rank's trainer for a run.

    `grad_sync` owns the gradients (buckets, hooks launched inside the backward); `optimizer` is the update
    after `finalize_grads` (`step(lr) -> grad norm`, `main_weight`, `loaded`, `reload_main`, `state_dict`);
    `replica`: work after each optimizer step (None: none); `watcher`: the loss observer whose decisions are
    run state (None: none); `replicas_group`: the ranks whose parameters are equal after every step;
    `same_norm`: every DP rank steps on the same gradient (its norm needs no agreement); `in_flight`: an
    exchange may stay in flight across steps (a step's end waits for its own stream only)."""

    grad_sync: GradSync
    optimizer: Any
    replica: Optional[ReplicaSync] = None
    watcher: Optional[Watcher] = None
    replicas_group: Group = None
    same_norm: bool = True
    in_flight: bool = False

    def after_step(self, step: int, last: bool) -> None:
        """The replica-level work due after optimizer step `step` (collective when due)."""
        if self.replica is not None:
            self.replica.after_step(step, last=last)

    def observe(self, step: int, loss: Callable[[], float]) -> Optional[str]:
        """Hand the step's DP-mean loss to the watcher (`loss()`: a host read, made only where a decision needs
        it); the line announcing a decision, else None."""
        return self.watcher.observe(step, loss) if self.watcher is not None else None

    def stage_record(self, step: int) -> dict[str, Any]:
        """The figures of the step after `step` steps done that the watcher keeps (e.g. the stage it ran)."""
        return self.watcher.record(step - 1) if self.watcher is not None else {}

    def replica_record(self, steps: int) -> dict[str, float]:
        """The replica-level figures over the `steps` steps of this run so far (collective when there are)."""
        return self.replica.record(steps) if self.replica is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Run-level state for the trainer's own (layout-independent) part of a checkpoint: the watcher's, under
        its `run_key` (the auto compression schedule's: "compression_schedule")."""
        state = self.watcher.run_state() if self.watcher is not None else None
        return {_run_key(self.watcher): state} if state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.watcher is not None and _run_key(self.watcher) in state:
            self.watcher.load_run_state(state[_run_key(self.watcher)])

    def restart(self, step: int) -> None:
        """After `model.init_from` wrote the weights: the replica-level state starts from them."""
        if self.replica is not None:
            self.replica.restart(step)

    def checkpoint_states(self) -> dict[str, Any]:
        """The checkpoint's "optimizer", "hook" (the per-rank compression state) and "sync" (per-replica) states."""
        hook = self.grad_sync.state if self.replica is None else self.replica.state
        return {"optimizer": self.optimizer, "hook": hook, "sync": self.replica}

    def hook_state(self) -> Any:
        """The per-step gradient hook's state (whose entries a skipped non-finite step drops)."""
        return self.grad_sync.state

    @property
    def verdict_on_device(self) -> bool:
        """Whether a non-finite step is refused on the device by an optimizer every DP rank steps alike, so the
        run's guard may read the verdict at its next logged or saved step instead of every step."""
        return self.same_norm and bool(getattr(self.optimizer, "defers_verdict", False))

    def synchronize(self, device: torch.device) -> None:
        """The end of a step on CUDA: the device's queue drained (the step's stream only while an exchange may
        be in flight across steps)."""
        if device.type == "cuda":
            (torch.cuda.current_stream() if self.in_flight else torch.cuda).synchronize()


def _run_key(watcher: Watcher) -> str:
    return getattr(watcher, "run_key", "compression_schedule")


class SyncMode(Protocol):
    """One way DP replicas agree (see the module doc)."""

    name: str

    def check(self, cfg: Config, layout: Layout) -> None: ...

    def build(self, cfg: Config, ctx: ParallelContext, model: nn.ModuleList,
              main: Optional[dict[nn.Parameter, torch.Tensor]], hook: Optional[tuple[CommHook, Any]]) -> DPPlan: ...

    def footprint(self, cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                  device: str, host: bool) -> Footprint: ...

    def startup(self, cfg: Config, layout: Layout) -> list[str]: ...


_MODES: dict[str, SyncMode] = {}  # filled by the mode modules when `hybrid.sync` is imported


def register_sync_mode(mode: SyncMode) -> SyncMode:
    """Make `mode` known as `sync.mode=<mode.name>` (the same object again is harmless; another of the name is
    refused)."""
    known = _MODES.get(mode.name)
    if known is not None and known is not mode:
        raise ValueError(f"sync mode {mode.name!r} is already registered")
    _MODES[mode.name] = mode
    return mode


def sync_mode_names() -> tuple[str, ...]:
    return tuple(_MODES)


def get_sync_mode(name: str) -> SyncMode:
    """The registered mode `name`; KeyError (the caller words it) for an unknown one."""
    return _MODES[name]
