"""0/1 Adam's optimizer (Lu, Li, Zhang, De Sa, He 2022, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", arXiv 2202.06009): Adam whose variance is refreshed on a schedule instead of frozen once,
whose momentum goes over DP as signs, and which takes local steps once the variance is frozen.

1-bit Adam freezes the variance after one exact warm-up, which must be long (25 % of the run here) for the frozen
value to hold. 0/1 Adam refreshes it from the exact gradient at steps whose spacing grows exponentially (the
variance changes slowly after the first steps) up to a freeze step F; between refreshes the momentum is
averaged as 1 bit per element; after F each replica steps alone and only the sum of its steps is synced, at
intervals that double up to H. Which step is which (refresh, onebit, local, sync) and the knobs:
`hybrid.compression.zeroone_adam`.

Per step t: g is this step's gradient clipped by the global norm (on a refresh step the exact DP mean ḡ, its
norm; otherwise each replica's own, as 1-bit Adam's, except in buckets kept exact — `compression.exact_params`,
their gradient the DP mean — clipped by the replicas' mean norm, the same factor everywhere, so they stay
alike); lr, wd, β₁, β₂, ε AdamW's; s the steps since the previous refresh and h the last refresh's step (the
paper's rule, `compression.var_refresh_every=0`: s = 1 and h the refreshes so far);
m̂ = m/(1 − β₁ᵗ), v̂ = v/(1 − β₂ʰ).

- refresh: m ← β₁m + (1 − β₁)ḡ, v ← β₂ˢv + (1 − β₂ˢ)ḡ², d = √v̂ + ε (√max(v̂, m̂²) + ε once a step before
  sent the momentum as signs);
- onebit: m ← the 1-bit DP mean of β₁m + (1 − β₁)gᵢ (1-bit Adam's exchange), d = √max(v̂, m̂²) + ε;
  on both: p ← p·(1 − lr·wd) − lr·m̂/d; every replica holds the same p and m after them.
- local (t > F): mᵢ ← β₁mᵢ + (1 − β₁)gᵢ; p ← p·(1 − lr·wd) − lr·m̂ᵢ/d, d = √max(v̂, m̂ᵢ²) + ε (v̂ frozen): 1-bit
  Adam's step on this replica's own momentum, nothing sent. The paper sums the steps in a buffer u; here, in
  units of d₀ = √v̂ + ε, u ← u·(1 − lr·wd) + lr·m̂ᵢ·d₀/d, and per parameter group S ← S·(1 − lr·wd) + lr (the
  paper's Σγ) and D ← D·(1 − lr·wd). Then p = a·D − u/d₀ exactly, a the anchor (p at the interval's start,
  the same on every replica).
- sync: a local step, then ū ← the 1-bit DP mean of u; m̂ ← ū/S (the paper's m = ū/Σγ: the interval's
  lr-weighted mean momentum) and p ← a·D − ū/d with d = √max(v̂, m̂²) + ε (the paper's θ = θ_t′ − ū/√v). u is
  not kept between steps: the sync forms it as (a·D − p)·d₀ in the momentum's buffer (replaced next anyway),
  and lands ū from a, D, S, v, the same numbers on every replica, so the replicas agree bit for bit after it.

**What goes over DP, and when** (a bucket of N fp32 elements, n DP ranks; E = ⌈N/n⌉ elements rounded up to
lcm(block, 8), as bytes E/8 + 4·E/block): a refresh step all-reduces each bucket's gradient in the backward (4N
bytes of payload, 2(n − 1)/n·4N on the wire) — the variance needs the exact ḡ², and ḡ updates m too, so nothing
else is sent; a onebit or sync step runs the two-phase sign exchange in the optimizer (an all-to-all and an
all-gather of n·E bytes each, (n − 1)·E each on the wire: ~28× fewer than fp32 at block 256) on m or u; a
local step sends nothing. Non-refresh steps add 1-bit Adam's uncounted 4-byte non-finite probe.

**Where hybrid departs from the paper**, for its own conventions: weight decay is AdamW's, decoupled (the
paper and DeepSpeed add wd·p to the update), so u, S and D decay with p and p = a·D − u/d₀ stays exact; m and v
are bias-corrected (DeepSpeed runs without); each refresh stands for the steps since the last one and the gap
is capped (above; `var_refresh_every=0`: the paper's, v an average over refreshes, not steps); clipping is by the
global norm; v̂ is floored at m̂² wherever it is stale or m carries the codec's error (OneBitAdam's floor: no
element moves more than lr per step, so the elements whose variance was ~0 at the freeze, e.g. rare tokens'
embedding rows, cannot jump), on every onebit step, on a refresh step once m holds signs (a 1-bit mean gives
each element its block's magnitude, and an element whose fresh ḡ² is small would step many times lr: on
llama-tiny +8.9 % eval loss without this floor, +1.7 % with it), on every local step with its own m̂ (u counts
what was stepped, in units of d₀) and at the sync's landing with the synced m̂ (there the 1-bit error of ū,
divided by a tiny d₀, would be unbounded); where no floor binds, every step is the paper's. A refresh step
folds ḡ into m and sends no 1-bit momentum besides (as DeepSpeed does); the residuals restart at the freeze,
where the exchanged quantity turns from m into u (as DeepSpeed's); the run's last step always syncs, so a run
ends with one model.

**State.** m and v are AdamW's `exp_avg` / `exp_avg_sq` (flat per bucket: `OneBitAdam.flat_state`), saved and
resharded by checkpoints; the schedule's position is the step count; the anchor and d (the step's
denominators) are two more flat buffers per bucket (4 bytes per parameter each). Between syncs each replica's p
and m are its own and a, D, S are in use: the hook's per-rank blob carries them (`local_state`), so a resume
under the same layout continues bit for bit. Under another layout the blob is dropped: every replica restarts
the interval from the checkpoint's p and m (for each tensor, one replica's), the residuals from 0; the next
sync brings the replicas together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.compression.onebit_adam import average_momentum
from hybrid.compression.zeroone_adam import LOCAL, ONEBIT, REFRESH, SYNC, ZeroOneExchange
from hybrid.optim.adamw import finite, global_grad_norm
from hybrid.optim.onebit_adam import OneBitAdam

if TYPE_CHECKING:
    from hybrid.compression.hooks import Compression
    from hybrid.parallel.context import ParallelContext
    from hybrid.parallel.dp.buckets import GradBucket


class ZeroOneAdam(OneBitAdam):
    """0/1 Adam over the `GradSync`'s `buckets`; `comp` is the hook's `Compression` state (its `state` the
    `ZeroOneExchange`, whose `owner` this becomes), `steps` the run's length (`train.steps`), from which the
    knobs left at 0 are sized."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[GradBucket], ctx: ParallelContext,
                 grad_clip: float, comp: Compression, steps: int) -> None:
        super().__init__(optimizer, buckets, ctx, grad_clip, comp)
        self.exchange: ZeroOneExchange = comp.state
        self.plan = self.exchange.schedule.sized(steps, optimizer.param_groups[0]["betas"][1])
        self.refresh = 0  # 1-bit Adam's every-k refresh is not 0/1 Adam's: `plan` says when it refreshes
        self.exchange.owner = self
        self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket index → flat (anchor, d)
        self._views: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter → its (anchor, d)
        self._group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._done: Optional[int] = None
        self._restart_interval()

    def refresh_due(self) -> bool:
        """Whether the step under way refreshes the variance (asked by the gradient hook in the backward)."""
        return self.plan.refresh(self._steps_done() + 1)

    def _steps_done(self) -> int:
        """Steps taken: AdamW's count, read once (after a construction or a load), then counted here (no device
        read per bucket on CUDA)."""
        if self._done is None:
            self._done = self.steps_taken()
        return self._done

    @torch.no_grad()
    def step(self, lr: float) -> torch.Tensor:
        """Set `lr`, clip by the global norm (a refresh step's synced gradient, else this replica's own), then the
        step of this step's kind; return the norm. A norm that is not finite on any replica updates nothing."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = global_grad_norm(self.params, self.ctx)
        t = self._steps_done() + 1
        kind = self.plan.kind(t)
        seen = norm if kind == REFRESH else self._over_dp(norm)
        if not finite(seen):
            return seen
        self._clip(norm, None if kind == REFRESH else seen)
        self._take(kind, lr, t)
        self._done = t
        return norm

    def _take(self, kind: str, lr: float, t: int) -> None:
        """Step t of `kind` (the state made where missing; the residuals restarted at the freeze)."""
        self._ensure_state()
        if t == self.plan.freeze + 1:  # the exchange turns from the momentum to u: other residuals
            self.exchange.worker.clear()
            self.exchange.server.clear()
        {REFRESH: self._refresh, ONEBIT: self._onebit, LOCAL: self._local_step, SYNC: self._sync_step}[kind](lr, t)

    def _refresh(self, lr: float, t: int) -> None:
        """m and v from the exact mean ḡ (the hook all-reduced it), v weighted by the steps since the last refresh
        (`gap`), then the step with the fresh variance, floored at m̂² once m holds signs (`signed`)."""
        beta1, decay = self._betas()[0], self._betas()[1] ** self.plan.gap(t)
        for bucket in self.buckets:
            m, v = self.flat_state(bucket)
            g = bucket.buffer()
            m.lerp_(g, 1 - beta1)
            v.mul_(decay).addcmul_(g, g, value=1 - decay)
        self._denominators(t, floor=self.plan.signed(t))
        self._apply(lr, t, accumulate=False)

    def _onebit(self, lr: float, t: int) -> None:
        """1-bit Adam's step: the momentum's 1-bit DP mean, the stale variance floored at m̂²."""
        self._average_momentum()
        self._denominators(t, floor=True)
        self._apply(lr, t, accumulate=False)

    def _local_step(self, lr: float, t: int) -> None:
        """This replica's own step: 1-bit Adam's without the exchange (its own momentum, the frozen variance floored
        at m̂²); D and S follow. The interval's first step takes the anchor a = p, the same on every replica."""
        for bucket in self.buckets if not self.since_sync else ():
            torch.cat([p.reshape(-1) for p in bucket.parameters()], out=self.local_buffers(bucket)[0])
        beta1 = self._betas()[0]
        for bucket in self.buckets:
            self.flat_state(bucket)[0].lerp_(bucket.buffer(), 1 - beta1)
        self._denominators(t, floor=True)
        self._apply(lr, t, accumulate=True)
        self.since_sync += 1

    def _sync_step(self, lr: float, t: int) -> None:
        """A local step, then the sum of this replica's steps, u, goes over DP as signs in the momentum's buffer (m
        is replaced anyway), and ū lands (`_land`) from the same numbers on every replica: alike bit for bit."""
        self._local_step(lr, t)
        moved = [b for b in self.buckets if not self.comp.kept_exact(b)]
        self._steps_sum(moved, t)
        average_momentum(self.comp, [(self.flat_state(b)[0], b) for b in moved])
        self._land(moved, t)
        self._restart_interval()

    def _steps_sum(self, moved: list[GradBucket], t: int) -> None:
        """u = (a·D − p)·d₀ (the paper's buffer, in units of d₀ = √v̂ + ε) into each `moved` bucket's m."""
        self._denominators(t, floor=False)
        for p in (p for b in moved for p in b.parameters()):
            (anchor, d), m = self._views[p], self.optimizer.state[p]["exp_avg"]
            torch.mul(anchor, self.decays[self._group_of[p]], out=m).sub_(p).mul_(d)

    def _land(self, moved: list[GradBucket], t: int) -> None:
        """ū (in the m of the `moved` buckets) lands: m̂ = ū/S, then p = a·D − ū/d with d = √max(v̂, m̂²) + ε."""
        bias = 1 - self._betas()[0] ** t
        params = [p for b in moved for p in b.parameters()]
        for p in params:
            s = self.sums[self._group_of[p]]
            self.optimizer.state[p]["exp_avg"].mul_(bias / s if s else 0.0)
        self._denominators(t, floor=True)
        for p in params:  # ū/d = S·m̂/d
            (anchor, d), i = self._views[p], self._group_of[p]
            p.copy_(anchor).mul_(self.decays[i]).addcdiv_(self.optimizer.state[p]["exp_avg"], d,
                                                          value=-self.sums[i] / bias)

    def _denominators(self, t: int, floor: bool) -> None:
        """d = √v̂ + ε, or √max(v̂, m̂²) + ε with `floor`, for every bucket, as after step t."""
        beta1, beta2 = self._betas()
        eps = self.optimizer.param_groups[0]["eps"]
        m_bias, v_bias = 1 - beta1 ** t, 1 - beta2 ** self.plan.horizon(t)
        for bucket in self.buckets:
            m, v = self.flat_state(bucket)
            d = self.local_buffers(bucket)[1]
            torch.div(v, v_bias, out=d)
            if floor:
                torch.maximum(d, (m / m_bias).square(), out=d)
            d.sqrt_().add_(eps)

    def _apply(self, lr: float, t: int, accumulate: bool) -> None:
        """p ← p·(1 − lr·wd) − lr·m̂/d per parameter group; with `accumulate`, D and S take the step too."""
        m_bias = 1 - self._betas()[0] ** t
        for i, group in enumerate(self.optimizer.param_groups):
            params = [p for p in group["params"] if p in self._views]
            if not params:
                continue
            states = [self.optimizer.state[p] for p in params]
            m_hat = torch._foreach_div([s["exp_avg"] for s in states], m_bias)
            decay = 1 - lr * group["weight_decay"]
            if group["weight_decay"]:
                torch._foreach_mul_(params, decay)
            torch._foreach_addcdiv_(params, m_hat, [self._views[p][1] for p in params], value=-lr)
            if accumulate:
                self.decays[i], self.sums[i] = self.decays[i] * decay, self.sums[i] * decay + lr
            for s in states:
                s["step"] += 1

    def _betas(self) -> tuple[float, float]:
        return self.optimizer.param_groups[0]["betas"]

    def _ensure_state(self) -> None:
        """AdamW's per-parameter state (zero moments, step 0) where a parameter has none yet (the first step)."""
        for p in self.params:
            if not self.optimizer.state[p]:
                self.optimizer.state[p] = self.fresh_state(p)

    def local_buffers(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """`bucket`'s flat (anchor, d: the step's denominators), laid out as the bucket; each parameter's views in
        `_views`."""
        if bucket.index() not in self._local:
            n = sum(p.numel() for p in bucket.parameters())
            anchor = torch.zeros(n, device=bucket.buffer().device)
            d = torch.ones_like(anchor)
            offset = 0
            for p in bucket.parameters():
                self._views[p] = tuple(x[offset: offset + p.numel()].view_as(p) for x in (anchor, d))
                offset += p.numel()
            self._local[bucket.index()] = (anchor, d)
        return self._local[bucket.index()]

    def _restart_interval(self) -> None:
        """No local step since a sync: D = 1, S = 0; the anchor to be taken at the next local step."""
        self.decays = [1.0] * len(self.optimizer.param_groups)
        self.sums = [0.0] * len(self.optimizer.param_groups)
        self.since_sync = 0

    def loaded(self) -> None:
        """After a checkpoint load: the replicas start a new interval from the loaded state, unless the hook's
        per-rank blob then restores this replica's (`load_local_state`)."""
        self._done = None
        self._restart_interval()

    def local_state(self) -> dict[str, Any]:
        """What a replica holds mid-interval beyond the checkpoint's tensors (its own p and m; the anchor, D, S):
        {} at a sync, where every replica holds the same."""
        if not self.since_sync:
            return {}
        return {"params": [p.detach().clone() for p in self.params],
                "exp_avg": [self.optimizer.state[p]["exp_avg"].clone() for p in self.params],
                "anchor": [self.local_buffers(b)[0].clone() for b in self.buckets],
                "decays": list(self.decays), "sums": list(self.sums), "since_sync": self.since_sync}

    @torch.no_grad()
    def load_local_state(self, sd: dict[str, Any]) -> None:
        """Restore `local_state()`'s (the same layout); {}: the interval starts afresh."""
        self._restart_interval()
        if not sd:
            return
        for p, w, m in zip(self.params, sd["params"], sd["exp_avg"]):
            p.copy_(w)
            self.optimizer.state[p]["exp_avg"].copy_(m)
        for bucket, anchor in zip(self.buckets, sd["anchor"]):
            self.local_buffers(bucket)[0].copy_(anchor)
        self.decays, self.sums, self.since_sync = list(sd["decays"]), list(sd["sums"]), int(sd["since_sync"])
