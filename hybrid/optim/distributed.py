"""The distributed optimizer (ZeRO-1 and 2, `parallel.zero=1|2`): AdamW's fp32 moments sharded over DP.

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
   for all of them first (`wait_params`).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.optim.adamw import adamw_over, clip_grads, counted_here, guarded_step, skips_on_device, total_squares
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext

if TYPE_CHECKING:
    from hybrid.config import OptimConfig
    from hybrid.parallel.dp.buckets import GradBucket
    from hybrid.parallel.dp.data import GradSync

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Fragment:
    """The part of `param` that lies in this rank's shard: elements `[lo, lo + n)` of the flattened
    parameter, at `at` in the bucket; `view` is that range of the parameter buffer as an AdamW parameter,
    its `.grad` the same range of the gradient buffer."""

    param: nn.Parameter
    lo: int
    at: int
    n: int
    view: nn.Parameter


@dataclass
class ShardedBucket:
    """One gradient bucket's parameter buffer (the parameters' dtype), this rank's shard `[start, start + k)`
    of it, the fragments in it, the shard's fp32 main weights (`main`: a view of the parameter buffer when
    that is fp32, its own k elements under bf16 parameters) and Adam moments (flat, `k` elements each)."""

    bucket: GradBucket
    params: torch.Tensor
    start: int
    k: int
    main: torch.Tensor
    fragments: list[Fragment] = field(default_factory=list)
    moments: dict[str, torch.Tensor] = field(default_factory=dict)

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start: self.start + self.k]

    def separate_main(self) -> bool:
        """Whether the main weights are a copy (bf16 parameters) rather than the parameter buffer itself."""
        return self.main.data_ptr() != self.shard(self.params).data_ptr()

    def spans(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """Every parameter of the bucket with its offset in the bucket and the flat range `[lo, hi)` of it
        that lies in this rank's shard (empty when lo == hi)."""
        out, offset = [], 0
        for p in self.bucket.parameters():
            n = p.numel()
            lo, hi = max(offset, self.start), min(offset + n, self.start + self.k)
            out.append((p, offset, lo - offset, max(lo, hi) - offset))
            offset += n
        return out


def shard_bucket(bucket: GradBucket, grads: torch.Tensor, dp: int, dp_rank: int,
                 main: Optional[dict[nn.Parameter, torch.Tensor]] = None) -> ShardedBucket:
    """Move `bucket`'s parameters into one flat buffer of their dtype (each `p.data` a view of it) and cut out
    this rank's fragments, whose gradients are ranges of `grads` (this rank's reduced gradient shard); `main`
    holds the fp32 values of bf16 parameters (their shard becomes the bucket's main weights). Padding stays
    zero: its gradient is zero, so AdamW leaves it there."""
    first = bucket.parameters()[0]
    params = torch.zeros(bucket.numel(), dtype=first.dtype, device=first.device)
    k = bucket.numel() // dp
    shard = params[dp_rank * k: (dp_rank + 1) * k]
    sb = ShardedBucket(bucket, params, dp_rank * k, k, shard if main is None else torch.zeros_like(grads))
    sb.moments = {m: torch.zeros(k, dtype=torch.float32, device=first.device) for m in MOMENTS}
    for p, offset, lo, hi in sb.spans():
        params[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = params[offset: offset + p.numel()].view_as(p)
        if lo < hi:
            at = offset + lo - sb.start
            if main is not None:
                sb.main[at: at + hi - lo].copy_(main[p].reshape(-1)[lo:hi])
            view = nn.Parameter(sb.main[at: at + hi - lo])
            view.grad = grads[at: at + hi - lo]
            sb.fragments.append(Fragment(p, lo, offset + lo, hi - lo, view))
    return sb


class DistributedOptimizer:
    """AdamW with clip-by-global-norm over the DP shards of `grad_sync`'s buckets (see the module doc).

    The same interface as `ModelOptimizer`: `step(lr) -> norm`; `param_groups` (the model's parameters, in
    the decay and no-decay groups) and `state` (per parameter, full shape) for the checkpoint."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, lr: float, ctx: ParallelContext,
                 grad_sync: GradSync, main: Optional[dict[nn.Parameter, torch.Tensor]] = None,
                 overlap: bool = False) -> None:
        if not grad_sync.sharded:
            raise ValueError("DistributedOptimizer needs GradSync(zero=1 or 2)")
        self.ctx, self.grad_clip, self.dp_group = ctx, cfg.grad_clip, grad_sync.group
        dp, dp_rank = C.size(self.dp_group), C.rank(self.dp_group)
        self.buckets = [shard_bucket(b, grad_sync.grad_shard(i), dp, dp_rank, main)
                        for i, b in enumerate(grad_sync.buckets)]
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
        self.gather_params(wait=not self.overlap)
        return norm

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
                sb.shard(sb.params).copy_(sb.main)

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
        """Wait for the parameter all-gathers of `buckets` (default: all) still in flight."""
        for i in list(self._inflight) if buckets is None else buckets:
            work = self._inflight.pop(i, None)
            if work is not None:
                with C.TIMER.waiting(C.group_name(self.dp_group)):
                    work.wait()

    def _wait_in_forward(self, model: nn.Module) -> None:
        """Forward pre-hooks: each transformer block waits for the buckets of its parameters, each chunk for
        those of the rest (embedding, head). Blocks, not their inner layers: a compiled block's inside is
        traced, and a wait cannot be."""
        where = {id(p): i for i, sb in enumerate(self.buckets) for p in sb.bucket.parameters()}
        for chunk in model:
            blocks = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
            inside = {id(p) for b in blocks for p in b.parameters()}
            outside = [p for p in chunk.parameters() if id(p) not in inside]
            for module, params in ((chunk, outside), *((b, list(b.parameters())) for b in blocks)):
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
        if any(sb.separate_main() for sb in self.buckets):
            self._take_view()
            self._round_shards()
            self.gather_params()

    def reload_main(self) -> None:
        """After `model.init_from` wrote the (bf16) parameters: this rank's main weights take their values."""
        with torch.no_grad():
            for sb in self.buckets:
                if sb.separate_main():
                    sb.main.copy_(sb.shard(sb.params))

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter view (a collective on first access after a step)."""
        return {"state": self.state, "param_groups": self._groups}
