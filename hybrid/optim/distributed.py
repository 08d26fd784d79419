"""The distributed optimizer (ZeRO-1, 2 and 3, `parallel.zero=1|2|3`): AdamW's fp32 moments sharded over DP.

`GradSync(zero=1)` pads every gradient bucket to dp equal shards and reduce-scatters it inside the
backward, so after `finalize_grads` DP rank r holds the DP mean of its shard `[r·k, (r+1)·k)` of each bucket
(`GradSync(zero=2)`: in a kept shard of its own, reduce-scattered every microbatch; `GradSync.grad_shard`).
This optimizer keeps, per bucket, a flat fp32 parameter buffer laid out as the gradient buffer (every
`p.data` is a view into it, Megatron's parameter buffer) and the Adam moments of its own shard only. A
parameter's *fragment* is the part of it that falls in the shard: a 1-D view of the parameter buffer whose
`.grad` is the same range of the gradient buffer. `step(lr)`:

1. the global norm: squares summed over this rank's fragments (a TP-replicated parameter's on TP rank 0
   only, the pipeline duplicate of a tied embedding never), **all-reduced over DP**, then TP, then PP;
2. clip the fragments' gradients by it, AdamW over the fragments (decay / no-decay groups as AdamW's);
3. **all-gather** every bucket's parameter shard over DP (launched bucket by bucket, the first layers'
   first), so every replica holds the whole updated model again. By default the step waits for them; with
   `parallel.overlap_param_gather=true` they stay in flight, and a forward pre-hook on each transformer
   block (and on each chunk, for the embedding and the head) waits for the buckets of its own parameters
   only, so the all-gather of later layers overlaps the forward of earlier ones (Megatron's
   `--overlap-param-gather`). Whatever reads the parameters otherwise (the next step, a checkpoint) waits
   for all of them first (`wait_params`). Under ZeRO-3 (`GradSync(zero=3)`) this rank's parameter shard is a
   tensor of its own that AdamW updates, and instead of the all-gather every unit's buffer is freed:
   `parallel.dp.units.Units` gathers each block where it is used next (`wait_params` gathers them all).

Bytes: the reduce-scatter and the all-gather together put on the wire what one ring all-reduce does,
(dp−1)/dp · 4N each; the moments take 8N/dp bytes per rank instead of 8N.

Under bf16 parameters (`train.precision=bf16_params`, `hybrid.optim.mixed`) the parameter buffer is bf16 and each
bucket keeps its shard's fp32 main weights beside it (4N/dp bytes): AdamW updates those, they are rounded
into the shard, and the all-gather moves bf16, (dp−1)/dp · 2N.

Checkpoints read Adam's state per parameter, in its full (TP-local) shape, through `state[p]`; reading
`state` after a step all-gathers each bucket's moment shards over DP (collective: every rank's checkpoint
code reads it at the same point) into a view that a save writes and a load fills; the next `step` copies
this rank's shard back from the view and drops it. So checkpoints are the same files as without ZeRO and
resume under any DP size, with or without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.optim.adamw import adamw_over, clip_grads, counted_here, guarded_step, skips_on_device, total_squares
from hybrid.optim.shards import MOMENTS, Fragment, shard_bucket
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.units import FlatParams, Units, chunk_units

if TYPE_CHECKING:
    from hybrid.config import OptimConfig
    from hybrid.parallel.dp.data import GradSync


class DistributedOptimizer:
    """AdamW with clip-by-global-norm over the DP shards of `grad_sync`'s buckets (see the module doc).

    The same interface as `ModelOptimizer`: `step(lr) -> norm`; `param_groups` (the model's parameters, in
    the decay and no-decay groups) and `state` (per parameter, full shape) for the checkpoint."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, lr: float, ctx: ParallelContext,
                 grad_sync: GradSync, main: Optional[dict[nn.Parameter, torch.Tensor]] = None,
                 overlap: bool = False, param_codec: Any = None, hpz: C.Group = None) -> None:
        if not grad_sync.sharded:
            raise ValueError("DistributedOptimizer needs GradSync(zero=1, 2 or 3)")
        self.ctx, self.grad_clip, self.dp_group = ctx, cfg.grad_clip, grad_sync.group
        dp, dp_rank, keep = C.size(self.dp_group), C.rank(self.dp_group), grad_sync.zero >= 3
        self.buckets, self.flats = [], []
        for i, b in enumerate(grad_sync.buckets):
            self.buckets.append(shard_bucket(b, grad_sync.grad_shard(i), dp, dp_rank, main, keep))
            if keep:  # ZeRO-3: freed at once, so the whole model is never here twice (its build, these buffers)
                self.flats.append(FlatParams(self.buckets[-1].params, self.buckets[-1].param_shard(), self.dp_group,
                                             param_codec, hpz))
                self.flats[-1].free()
        self.units: Optional[Units] = None  # ZeRO-3: the parameters gathered unit by unit, freed between uses
        if keep:
            self.units = Units(model, {id(p): f for sb, f in zip(self.buckets, self.flats)
                                       for p in sb.bucket.parameters()})
        self.steps = 0  # AdamW's step count (also in every fragment's state; a rank may own no fragment)
        decay = [f.view for f in self.fragments() if f.param.ndim >= 2]
        no_decay = [f.view for f in self.fragments() if f.param.ndim < 2]
        self.optimizer = adamw_over(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], cfg, lr)
        for sb in self.buckets:  # fused kernels take the step count on the parameter's device, foreach on the CPU
            on = sb.params.device if cfg.implementation == "fused" else torch.device("cpu")
            for f in sb.fragments:
                at = f.at - sb.start
                self.optimizer.state[f.view] = {"step": torch.zeros((), device=on),
                                                **{m: sb.moments[m][at: at + f.n] for m in MOMENTS}}
        self._groups = [{"params": [p for p in model.parameters() if p.requires_grad and (p.ndim >= 2) == d]}
                        for d in (True, False)]
        self._view: Optional[dict[nn.Parameter, dict[str, torch.Tensor]]] = None
        self._inflight: dict[int, Any] = {}  # bucket index → its parameter all-gather's work, not yet waited
        self.overlap = overlap
        if overlap:
            self._wait_in_forward(model)

    def fragments(self) -> list[Fragment]:
        return [f for sb in self.buckets for f in sb.fragments]

    def step(self, lr: float) -> torch.Tensor:
        """Set `lr`, clip this rank's shard of the final gradients by the global norm, AdamW over the shard,
        all-gather the updated parameter shards over DP (left in flight under `overlap`); return the norm
        before clipping. A non-finite norm updates nothing (refused on the device by the fused kernels; else no step
        and no all-gather: the parameters stand)."""
        if self.units is None:
            self.wait_params()  # a parameter no forward used may still be gathering
        self._take_view()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = self.grad_norm()  # the same on every rank (all-reduced over DP, TP, PP): so is the verdict
        clip_grads([f.view for f in self.fragments()], self.grad_clip, norm)
        if not guarded_step(self.optimizer, norm):
            return norm
        self._count_step()
        self._round_shards()  # a step refused on the device rounds and gathers the parameters it left as they were
        self._publish()
        return norm

    def _publish(self) -> None:
        """The updated shards to the model: all-gathered (ZeRO-1, 2), or every gathered unit freed, to be gathered
        afresh where it is used next (ZeRO-3)."""
        if self.units is not None:
            self.units.free_all()
        else:
            self.gather_params(wait=not self.overlap)

    @property
    def steps(self) -> int:
        """AdamW's step count: the steps taken, less those the fused kernel refused on the device (read here)."""
        return self._taken - (int(self._refused) if self._refused is not None else 0)

    @steps.setter
    def steps(self, n: int) -> None:
        self._taken, self._refused = n, None

    @property
    def defers_verdict(self) -> bool:
        """Whether a non-finite step is refused on the device, so the run's guard may read the verdict later."""
        return skips_on_device(self.optimizer)

    def _count_step(self) -> None:
        """One more step, and its refusal flag (fused kernels) summed on the device: no host read."""
        self._taken += 1
        flag = getattr(self.optimizer, "found_inf", None)
        if flag is not None:
            self._refused = flag if self._refused is None else self._refused + flag

    @torch.no_grad()
    def _round_shards(self) -> None:
        """Under bf16 parameters: this rank's updated fp32 main weights rounded into its parameter shards."""
        for sb in self.buckets:
            if sb.separate_main():
                sb.param_shard().copy_(sb.main)

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm from this rank's fragments: the squares all-reduced over DP (each
        shard's owner counts it once), then TP, then PP, with `global_grad_norm`'s rules for duplicates."""
        device = self.buckets[0].params.device if self.buckets else torch.device("cpu")
        sq = total_squares([f.view.grad for f in self.fragments() if counted_here(f.param, self.ctx.tp_rank)], device)
        for group in (self.dp_group, self.ctx.tp_group, self.ctx.pp_group):
            C.all_reduce(sq, group)
        return sq.sqrt()

    @torch.no_grad()
    def gather_params(self, wait: bool = True) -> None:
        """All-gather every bucket's updated shard over DP, in place into its parameter buffer: launched
        bucket by bucket, the last bucket (the first layers' parameters) first, then waited for unless not
        `wait` (`wait_params` or the forward's hooks wait then)."""
        for i in reversed(range(len(self.buckets))):
            sb = self.buckets[i]
            work = C.all_gather_flat(sb.params, sb.shard(sb.params), self.dp_group, async_op=True)
            if work is not None:
                self._inflight[i] = work
        if wait:
            self.wait_params()

    def wait_params(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (default: all) still in flight: every parameter is
        readable on return. Under ZeRO-3 every unit is gathered (collective; freed again by the next step)."""
        if self.units is not None:
            self.units.gather_all()
            return
        for i in list(self._inflight) if buckets is None else buckets:
            work = self._inflight.pop(i, None)
            if work is not None:
                with C.TIMER.waiting(C.group_name(self.dp_group), "all_gather"):
                    work.wait()

    def _wait_in_forward(self, model: nn.Module) -> None:
        """Forward pre-hooks: each transformer block waits for the buckets of its parameters, each chunk for
        those of the rest (embedding, head). Blocks, not their inner layers: a compiled block's inside is
        traced, and a wait cannot be."""
        where = {id(p): i for i, sb in enumerate(self.buckets) for p in sb.bucket.parameters()}
        for chunk, root, blocks in chunk_units(model):
            for module, params in ((chunk, root), *((b, list(b.parameters())) for b in blocks)):
                ids = sorted({where[id(p)] for p in params if id(p) in where})
                module.register_forward_pre_hook(lambda _m, _a, ids=ids: self.wait_params(ids))

    # ---- the checkpoint's per-parameter view ------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups

    @property
    def state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Adam's state per model parameter, full shape: built on first access after a step by all-gathering
        every bucket's moment shards over DP (a collective); copied back into the shards by the next step."""
        if self._view is None:
            self.wait_params()
            self._view = self._gather_view()
        return self._view

    def main_weight(self, p: nn.Parameter) -> torch.Tensor:
        """What a checkpoint holds as `p`'s weight: `p` itself (fp32), or under bf16 parameters its fp32 main
        weights gathered into the per-parameter view (a collective on first access after a step)."""
        self.wait_params()
        return self.state[p].get("main", p.detach())

    @torch.no_grad()
    def _gather_view(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        view: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for sb in self.buckets:
            names = MOMENTS + (("main",) if sb.separate_main() else ())
            shards = {**sb.moments, "main": sb.main}
            full = {m: torch.empty(sb.bucket.numel(), device=sb.params.device) for m in names}
            for m in names:
                C.all_gather_flat(full[m], shards[m], self.dp_group)
            for p, offset, _, _ in sb.spans():
                view[p] = {"step": torch.tensor(float(self.steps)),
                           **{m: full[m][offset: offset + p.numel()].view_as(p) for m in names}}
        return view

    @torch.no_grad()
    def _take_view(self) -> None:
        """Copy this rank's shard of the view (a load may have written it) back into the moments and the
        step count into every fragment's state; drop the view."""
        if self._view is None:
            return
        for sb in self.buckets:
            for p, offset, lo, hi in sb.spans():
                state = self._view[p]
                self.steps = int(state["step"])
                at = offset + lo - sb.start
                shards = {**sb.moments, "main": sb.main}
                for m in MOMENTS + (("main",) if "main" in state else ()):
                    shards[m][at: at + hi - lo].copy_(state[m].reshape(-1)[lo:hi])
        for state in self.optimizer.state.values():
            state["step"].fill_(self.steps)
        self._view = None

    def loaded(self) -> None:
        """After a checkpoint load: under bf16 parameters the loaded main weights are this rank's shards, then
        every parameter (rounding and an all-gather over DP: collective, as the load). In fp32 the load wrote
        the parameters themselves; the moments are taken from the view at the next step either way."""
        if self.units is not None:  # the load wrote the gathered parameters (fp32) or the view's main weights
            self._keep_gathered()
        if any(sb.separate_main() for sb in self.buckets):
            self._take_view()
            self._round_shards()
        if self.units is not None or any(sb.separate_main() for sb in self.buckets):
            self._publish()

    @torch.no_grad()
    def _keep_gathered(self) -> None:
        """ZeRO-3: this rank's shard of the gathered parameters (written by a load) into its kept shard."""
        for sb, flat in zip(self.buckets, self.flats):
            if flat.gathered and sb.kept is not None:
                sb.kept.copy_(sb.shard(sb.params))

    def reload_main(self) -> None:
        """After `model.init_from` wrote the (bf16) parameters: this rank's main weights take their values (under
        ZeRO-3 the gathered parameters' shards, first, its kept shards)."""
        if self.units is not None:
            self._keep_gathered()
        with torch.no_grad():
            for sb in self.buckets:
                if sb.separate_main():
                    sb.main.copy_(sb.param_shard())
        if self.units is not None:
            self.units.free_all()

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter view (a collective on first access after a step)."""
        return {"state": self.state, "param_groups": self._groups}
