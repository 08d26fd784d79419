"""A step whose gradient is not finite never trains the model: `train.on_nonfinite` says what the run does.

Every optimizer returns the global gradient norm without updating anything when the norm is NaN or inf
(`optim.adamw.finite`). That norm is all-reduced over TP and PP (and over DP under ZeRO-1; the DP
replicas of the other optimizers hold the same synced gradient, and 1-bit Adam adds a 4-byte DP
all-reduce after its warm-up, when they do not), so every rank of the world sees the same verdict
without a collective of its own: as Megatron's `found_inf`, agreed over the model-parallel group.
On a bad step only, `Guard.inspect` finds the first parameter whose gradient is not finite (two small
collectives, reached by every rank alike) and `Guard.settle` acts:

- `stop` (default): `NonFiniteStop`, one line on every rank naming the step, the loss, the norm and
  that parameter; exit status 1 (`hybrid.train`).
- `skip`: the step is counted (the data moves on) but nothing is updated, one warning line; the LR
  schedule does not advance on a skipped step (Megatron: its scheduler steps only on a successful
  update), so the LR of step s is the schedule's at s − skipped, and the skipped count is part of the run's
  state (checkpointed, in every metrics record as `skipped_steps`). The DP hook's state entries that the
  bad gradient made non-finite (error-feedback residuals, PowerSGD's Qs) are dropped: the hook starts them
  afresh. `train.max_skipped_steps` in a row stop.
- `rewind`: the newest complete checkpoint of the run is loaded in place (`Checkpointer.load`, the resume
  path) and the run goes on from its step with the data position of the step that blew up kept, so the
  batches from the checkpoint up to that one are skipped (as large runs do after a loss spike). No
  checkpoint is a stop; so is a rewind more than `train.max_skipped_steps` times in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist

from hybrid.checkpoint.files import list_steps, problem, read_manifest
from hybrid.parallel.dp.grads import grad_of

if TYPE_CHECKING:
    from torch import nn

    from hybrid.checkpoint import Checkpointer
    from hybrid.config import TrainConfig
    from hybrid.parallel.context import ParallelContext


class NonFiniteStop(RuntimeError):
    """A step's gradient was not finite and the run stops (nothing was updated): one line, exit status 1."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def first_nonfinite_grad(model: nn.ModuleList) -> Optional[str]:
    """The global name of this rank's first parameter whose gradient holds a NaN or an inf, else None."""
    from hybrid.checkpoint.state import named_parameters  # DCP's room: loaded once a run trains

    for name, p in named_parameters(model, True):
        g = grad_of(p)
        if g is not None and not bool(torch.isfinite(g).all()):
            return name
    return None


def agree_on_first(name: Optional[str], rank: int, device: torch.device) -> tuple[Optional[str], int]:
    """(name, rank) of the lowest rank that found a non-finite gradient, the same on every rank; (None, -1)
    when none did (the squares overflowed in the norm). Collectives over the world: an all_reduce (MIN) of
    the rank, then a broadcast of its name from that rank."""
    world = _world()
    first = torch.tensor([rank if name is not None else world], device=device)
    if world > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        box = [name]
        if int(first) < world:
            dist.broadcast_object_list(box, src=int(first))
        name = box[0]
    return (name, int(first)) if int(first) < world else (None, -1)


def newest_before(root: Path, step: int) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest complete checkpoint of `root` older than `step`, with its manifest; None when there is none."""
    for s, path in reversed(list_steps(root)):
        if s < step and problem(path) is None:
            return path, read_manifest(path)
    return None


def finite_tree(value: Any) -> bool:
    """False when `value` is, or is a list of, tensors holding a NaN or an inf (a dict: True, it is walked)."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    return all(map(finite_tree, value)) if isinstance(value, (list, tuple)) else True


def without_nonfinite(sd: Any) -> Any:
    """A DP hook's state dict without the entries (per bucket: a residual, PowerSGD's Qs, DGC's velocity) that
    hold a NaN or an inf: every hook starts a missing entry afresh, as at its first step."""
    if isinstance(sd, dict):
        return {k: without_nonfinite(v) for k, v in sd.items() if finite_tree(v)}
    return [without_nonfinite(x) for x in sd] if isinstance(sd, list) else sd


def rank0_answer(find: Callable[[], Any]) -> Any:
    """`find()` on rank 0, the same answer on every rank. Collective: one broadcast_object_list over the world."""
    box = [find() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Result(Protocol):
    """A step's result as the guard reads it: its DP-mean loss (a host read, made on a bad step only)."""

    @property
    def loss(self) -> float: ...


class Position(Protocol):
    """What the guard needs of the run it watches: the step reached (a rewind's load sets it back) and the data
    order, whose position a rewind keeps past the bad batch."""

    step: int
    sampler: Stateful


class Guard:
    """`train.on_nonfinite` for one rank's trainer: `inspect` after the optimizer's step (before the
    gradients are zeroed), `settle` after the step; `lr_step` is where the LR schedule stands."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, checkpointer: Checkpointer,
                 say: Callable[[str], None], same_norm: bool = True, hook_state: Callable[[], Any] = lambda: None,
                 deferred: bool = False) -> None:
        self.mode, self.limit = cfg.on_nonfinite, cfg.max_skipped_steps
        self.same_norm = same_norm  # False: DP replicas step on their own gradients (`DPPlan.same_norm`)
        self.hook_state = hook_state  # the DP hook's state, whose entries a skipped step drops
        self.ctx, self.checkpointer, self.say = ctx, checkpointer, say
        self.skipped = 0  # steps skipped in the whole run (checkpointed: the LR schedule's position)
        self.in_a_row = 0
        self.rewinds = 0  # in this process
        self.found: Optional[tuple[float, Optional[str], int]] = None  # the bad step's norm, parameter, rank
        self.deferred = deferred and self.mode == "stop"  # the verdict read at the steps `inspect` is told are due
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, norm, loss) not read yet
        self.late = ""  # the line of a non-finite step read late (`pending_verdict`)

    def lr_step(self, step: int) -> int:
        """The LR schedule's step for optimizer step `step`: skipped steps do not advance it."""
        return step - self.skipped

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's count (0 in a checkpoint from before the key existed)."""
        self.skipped = int(state.get("skipped_steps", 0))

    def record(self) -> dict[str, int]:
        """The metrics record's `skipped_steps`: steps skipped so far in the run."""
        return {"skipped_steps": self.skipped}

    def inspect(self, norm: torch.Tensor, model: nn.ModuleList, step: int = 0, loss: Optional[torch.Tensor] = None,
                due: bool = True) -> None:
        """After `optimizer.step` (which updated nothing when `norm` is not finite): on such a step, find the
        first parameter with a non-finite gradient (collectives of `agree_on_first`, on a bad step only:
        `norm` is the same on every rank, so every rank takes this branch alike). When DP replicas step on their
        own gradients (`same_norm` False), one world all-reduce of a flag every step makes the verdict the
        world's first (the replicas whose gradient was finite have stepped).

        `deferred` (stop, with an optimizer that refuses a non-finite step on the device): a step that is not
        `due` (the same steps on every rank: logged, checkpointed, the last) only keeps its norm and loss on the
        device; a due step reads them all at once (`pending_verdict`): a bad earlier step is found late, unnamed;
        a bad due step itself is named as without deferral (its gradients are still there)."""
        self.found, self.late = None, ""
        if self.deferred:
            self.pending.append((step, norm, torch.zeros(()) if loss is None else loss))
            self.found = self.pending_verdict() if due else None
            if self.found is None or self.late:
                return
        value = float(norm)
        if not self.same_norm and _world() > 1:  # each replica its own norm: the verdict (inf over nan) the world's
            bad = torch.tensor([float(math.isnan(value)), float(math.isinf(value))], device=norm.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            value = math.inf if bad[1].item() else (math.nan if bad[0].item() else value)
        if not math.isfinite(value):
            name, rank = agree_on_first(first_nonfinite_grad(model), self.ctx.rank, norm.device)
            self.found = (value, name, rank)

    def settle(self, trainer: Position, result: Result) -> bool:
        """After step `trainer.step`: nothing on a finite step; else stop, skip or rewind (True: rewound, the
        trainer is back at a checkpoint's step and this step is not logged). Every rank takes the same branch
        (`inspect`'s verdict is the world's); only a rewind runs collectives (its broadcast and the load)."""
        if self.found is None:
            self.in_a_row = 0
            return False
        what = self.late or self.describe(trainer.step, result.loss)
        if self.mode == "stop":
            self.stop(f"{what}; stopped (train.on_nonfinite=stop; skip or rewind go on past such a step)")
        if self.mode == "skip":
            return self.skip(what)
        return self.rewind(trainer, what)

    def pending_verdict(self, at_hand: bool = True) -> Optional[tuple[float, Optional[str], int]]:
        """The steps kept since the last read, read in one host transfer: the first whose norm is not finite,
        as `found`. Unless it is the last step kept and that step is `at_hand` (its gradients still there for
        `inspect` to name the parameter), it is left unnamed and its line goes to `late`. None when all were
        finite. Every rank reads the same norms: all answer alike, no collective."""
        pending, self.pending = self.pending, []
        if not pending:
            return None
        norms = torch.stack([n.float().reshape(()) for _, n, _ in pending])
        losses = torch.stack([x.float().reshape(()).to(norms.device) for _, _, x in pending])
        for (step, _, _), (norm, loss) in zip(pending, torch.stack([norms, losses], dim=1).tolist()):
            if not math.isfinite(norm):
                if at_hand and step == pending[-1][0]:
                    return norm, None, -1  # the step at hand: `inspect` names its parameter
                self.late = (f"step {step}: the gradient is not finite (loss {loss:.6g}, grad norm {norm}); not "
                             f"applied (refused on the device; read at step {pending[-1][0]}, the next logged or "
                             "checkpointed step: the run went on to it on finite gradients; logging.log_every=1 "
                             "reads every step and names the first non-finite gradient)")
                return norm, None, -1
        return None

    def verify(self) -> None:
        """Before a checkpoint is written: any step kept unread is read now; a non-finite one stops the run
        (`stop`), so no state after it is ever saved. Every rank saves at the same steps, so all read alike."""
        if self.deferred and (found := self.pending_verdict(at_hand=False)) is not None:
            self.found = found
            self.stop(f"{self.late}; stopped (train.on_nonfinite=stop; skip or rewind go on past such a step)")

    def describe(self, step: int, loss: float) -> str:
        """The bad step in words: its number, loss, norm and the first parameter whose gradient is not finite."""
        norm, name, rank = self.found or (math.nan, None, -1)
        where = (f"first non-finite gradient: {name} (rank {rank})" if name is not None
                 else "every gradient is finite but their squares overflow the norm")
        return f"step {step}: the gradient is not finite (loss {loss:.6g}, grad norm {norm}; {where}); not applied"

    def stop(self, line: str) -> None:
        """Raise NonFiniteStop with `line` and where the run can resume from (any async save completed first)."""
        self.checkpointer.wait()
        latest = self.checkpointer.root / "latest"
        kept = f"the last checkpoint ({latest.resolve()}) is kept" if latest.exists() else "no checkpoint was saved"
        raise NonFiniteStop(f"{line}; {kept}")

    def skip(self, what: str) -> bool:
        """Skip the step (nothing was updated; the DP hook's state entries the bad gradient made non-finite
        are dropped), or stop when it would be one too many in a row. No collective."""
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            self.stop(f"{what}; {self.in_a_row} such steps in a row (train.max_skipped_steps={self.limit}): stopped")
        self.skipped += 1
        hook = self.hook_state()  # its error feedback took the bad gradient in: that part starts afresh
        if hasattr(hook, "state_dict"):
            hook.load_state_dict(without_nonfinite(hook.state_dict()))
        self.say(f"warning: {what}: skipped ({self.in_a_row} in a row, at most {self.limit}; "
                 f"{self.skipped} in the run)")
        return False

    def rewind(self, trainer: Position, what: str) -> bool:
        """Load the newest checkpoint before this step and keep the data position past the bad batch.
        Collectives: rank 0's choice broadcast, then the load's (DCP's plan exchange)."""
        if self.rewinds >= self.limit:
            self.stop(f"{what}; rewound {self.rewinds} times already (train.max_skipped_steps={self.limit}): stopped")
        self.checkpointer.wait()
        found = rank0_answer(lambda: newest_before(self.checkpointer.root, trainer.step))  # (path, manifest)
        if found is None:
            self.stop(f"{what}; train.on_nonfinite=rewind has no checkpoint of this run to rewind to "
                      f"(in {self.checkpointer.root}; save some with checkpoint.every=N)")
        bad, position = trainer.step, trainer.sampler.state_dict()  # the data position after the bad batch
        self.checkpointer.load(Path(found[0]), found[1])
        trainer.sampler.load_state_dict(position)
        self.rewinds += 1
        self.say(f"warning: {what}: rewound to step {trainer.step} ({found[0]}), the batches of steps "
                 f"{trainer.step + 1}-{bad} skipped (rewind {self.rewinds} of at most {self.limit})")
        return True
