"""1-bit Adam's optimizer (Tang et al. 2021): AdamW for a warm-up, then steps on the DP-averaged momentum with
Adam's variance frozen, or refreshed every k-th step from the exact DP mean of the gradients. The momentum's
exchange, the refresh and the algorithm are described in `hybrid.compression.onebit_adam`; this is the optimizer
side.

The floor is ours, not the paper's: a second moment is never below the squared first (E[g²] ≥ E[g]²), but a
variance frozen early can be, for elements whose gradients grew after the warm-up (on gpt-tiny, attention
weights once the loss leaves its unigram plateau). Their steps then exceed lr many-fold; floored, no element
moves more than lr per step, as in Adam. Without it, 200 steps of gpt-tiny at dp=4 ended 10% above exact
AdamW's eval loss with an exact (uncompressed) momentum exchange; with it, 1.6%.

The momentum of each gradient bucket lives in one flat buffer laid out as the bucket (the optimizer state's
`exp_avg` of each parameter is a view into it), so the exchange runs on it in place; `exp_avg_sq` is kept the
same way. Both stay AdamW's per-parameter state, so checkpoints save and reshard them as for AdamW (a
DP-size change keeps the frozen variance and the averaged momentum); the residuals are the hook state's
per-rank blob (`Compression.state_dict`), restored under the same layout and zero after a layout change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from hybrid.compression.onebit_adam import MomentumExchange, average_momentum, refresh_every
from hybrid.optim.adamw import ModelOptimizer, clip_grads, finite, global_grad_norm
from hybrid.parallel import collectives as C

if TYPE_CHECKING:
    from hybrid.compression.hooks import Compression
    from hybrid.parallel.context import ParallelContext
    from hybrid.parallel.dp.buckets import GradBucket


class OneBitAdam(ModelOptimizer):
    """AdamW for the warm-up, then the frozen-variance step on the compressed DP mean of the momentum.

    `buckets` are the `GradSync`'s (their flat buffers hold this rank's gradients); `comp` is the hook's
    `Compression` state, whose exact stage (`warmup_steps`, or the auto schedule's) is AdamW's and whose
    `measure` flag asks for the momentum's compression error (one exact all-reduce per buffer, counted as
    `bytes_meter`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[GradBucket], ctx: ParallelContext,
                 grad_clip: float, comp: Compression) -> None:
        super().__init__(optimizer, [p for b in buckets for p in b.parameters()], ctx, grad_clip)
        self.buckets, self.comp = buckets, comp
        self.exchange: MomentumExchange = comp.state
        self.refresh = refresh_every(self.exchange.refresh, optimizer.param_groups[0]["betas"][1])
        self._flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def defers_verdict(self) -> bool:
        """False: the compressed-momentum step is hybrid's own, decided on the host (one read per step)."""
        return False

    def steps_taken(self) -> int:
        """Optimizer steps taken so far (AdamW's `step` count, restored with the checkpoint)."""
        state = self.optimizer.state.get(self.params[0]) if self.params else None
        return int(state["step"]) if state else 0

    def step(self, lr: float) -> torch.Tensor:
        """Set `lr`, clip by the global norm (TP then PP: this replica's own gradient after the warm-up), then
        AdamW's step or the compressed-momentum step; return the norm before clipping. A norm that is not
        finite on any replica updates nothing on every replica (and is what they all return)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = global_grad_norm(self.params, self.ctx)
        stage = self.comp.stage_at(self.steps_taken())
        seen = self._over_dp(norm) if stage else norm  # after the warm-up each replica has its own gradient
        if not finite(seen):
            return seen
        self._clip(norm, seen if stage else None)
        if stage == 0:
            self.optimizer.step()
        else:
            self._average_momentum()
            self._refresh_variance()
            self._frozen_step(lr)
        return norm

    def refreshed_at(self, t: int) -> int:
        """The step whose variance the compressed step `t` uses: the last refresh at or before `t` (every
        `refresh`-th step after the exact stage's end), or the exact stage's last step."""
        warm = self.comp.exact_steps()
        return warm + (t - warm) // self.refresh * self.refresh if self.refresh else warm

    def _clip(self, norm: torch.Tensor, summed: Optional[torch.Tensor]) -> None:
        """Clip by the global norm: the synced gradient's while exact; otherwise (`summed`: the replicas'
        norms summed over DP) this replica's own, but the buckets kept exact — their gradient the DP mean, the
        same everywhere — by the replicas' mean norm, the same factor everywhere, so that they stay alike."""
        if summed is None:
            return clip_grads(self.params, self.grad_clip, norm)
        exact = {p for b in self.buckets if self.comp.kept_exact(b) for p in b.parameters()}
        clip_grads([p for p in self.params if p not in exact], self.grad_clip, norm)
        clip_grads([p for p in self.params if p in exact], self.grad_clip, summed / C.size(self.ctx.dp_group))

    def _over_dp(self, norm: torch.Tensor) -> torch.Tensor:
        """The replicas' norms summed over DP: non-finite on every replica when one replica's is. One 4-byte
        all-reduce (uncounted: a decision, not training traffic), needed only after the warm-up, when the
        replicas' gradients differ; before it they are synced, so their norms are already equal."""
        probe = norm.clone()
        if C.size(self.ctx.dp_group) > 1:
            with C.TIMER.collective(C.group_name(self.ctx.dp_group), "nonfinite"):
                dist.all_reduce(probe, group=self.ctx.dp_group)
        return probe

    def _average_momentum(self) -> None:
        """m ← β₁·m + (1 − β₁)·g per bucket (g: this rank's clipped gradient), then the DP mean of every
        bucket's m by the two-phase sign exchange (`compression.onebit_adam.average_momentum`). A bucket kept
        exact (`compression.exact_params`) had its gradient all-reduced by the hook: its m is already equal."""
        beta1 = self.optimizer.param_groups[0]["betas"][0]
        buffers = []
        for bucket in self.buckets:
            m, _ = self.flat_state(bucket)
            m.lerp_(bucket.buffer(), 1 - beta1)
            if not self.comp.kept_exact(bucket):
                buffers.append((m, bucket))
        average_momentum(self.comp, buffers)

    def _refresh_variance(self) -> None:
        """On a refresh step (`refreshed_at`), v ← β₂ᵏ·v + (1 − β₂ᵏ)·ḡ² per bucket (k = `refresh`), ḡ the exact DP
        mean of the clipped gradients: the compressed buckets' gradients all-reduced in fp32 in place (each rank's
        is in its momentum already; counted as DP traffic), the kept-exact buckets' already the mean. Every rank
        gets the same v."""
        t = self.steps_taken() + 1
        if self.refreshed_at(t) != t:
            return
        compressed = [b for b in self.buckets if not self.comp.kept_exact(b)]
        works = [C.all_reduce(b.buffer(), self.ctx.dp_group, async_op=True) for b in compressed]
        with C.TIMER.waiting(C.group_name(self.ctx.dp_group)):
            for work in works:
                if work is not None:
                    work.wait()
        decay, n = self.optimizer.param_groups[0]["betas"][1] ** self.refresh, C.size(self.ctx.dp_group)
        reduced = {id(b) for b in compressed}
        for bucket in self.buckets:
            g = bucket.buffer().div_(n) if id(bucket) in reduced else bucket.buffer()
            self.flat_state(bucket)[1].mul_(decay).addcmul_(g, g, value=1 - decay)

    @torch.no_grad()
    def _frozen_step(self, lr: float) -> None:
        """AdamW's update with the averaged momentum and the variance of its last refresh (or of the warm-up's last
        step), floored at the squared momentum (bias-corrected both)."""
        t = self.steps_taken() + 1
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p in self.optimizer.state]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self.optimizer.state[p] for p in params]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            v_hat = torch._foreach_div([s["exp_avg_sq"] for s in states], 1 - beta2 ** self.refreshed_at(t))
            m_hat = torch._foreach_div([s["exp_avg"] for s in states], 1 - beta1 ** t)
            torch._foreach_maximum_(v_hat, torch._foreach_mul(m_hat, m_hat))  # the floor: v̂ ≥ m̂²
            denom = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, m_hat, denom, value=-lr)
            for s in states:
                s["step"] += 1

    def flat_state(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """`bucket`'s flat (momentum, variance), the parameters' `exp_avg` / `exp_avg_sq` being views into
        them; (re)built from the per-parameter state when that is not (AdamW's warm-up, a fresh load)."""
        flat = self._flat.get(bucket.index())
        states = [self.optimizer.state[p] for p in bucket.parameters()]
        if flat is None or not _views_of(flat, states):
            flat = self._flat[bucket.index()] = _flatten(bucket.parameters(), states)
        return flat


def _views_of(flat: tuple[torch.Tensor, torch.Tensor], states: list[dict[str, Any]]) -> bool:
    m, v = flat
    offset = 0
    for s in states:
        if s["exp_avg"].data_ptr() != m[offset:].data_ptr() or s["exp_avg_sq"].data_ptr() != v[offset:].data_ptr():
            return False
        offset += s["exp_avg"].numel()
    return True


def _flatten(params: list[torch.Tensor], states: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One flat momentum and one flat variance buffer in the bucket's order; the state entries become views."""
    out: list[Optional[torch.Tensor]] = []
    for key in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([s[key].reshape(-1) for s in states])
        offset = 0
        for p, s in zip(params, states):
            s[key] = flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        out.append(flat)
    return out[0], out[1]
