"""Deep Gradient Compression (Lin et al. 2018): top-k with the corrections that keep it converging.

Plain top-k with error feedback accumulates the *raw* gradients of the elements it did not send. DGC adds,
per gradient bucket on each rank, before the two-phase top-k exchange of `codecs.py`:

1. **local gradient clipping**: this rank's bucket gradient is scaled to a norm of at most
   `compression.dgc_clip / √dp` (the threshold of a global clip shared by dp summed gradients; per bucket,
   because the hook sees one bucket at a time, inside the backward; 0 turns it off);
2. **momentum correction**: the velocity u ← μ·u + g (μ = `compression.dgc_momentum`) is what accumulates, so
   an element sent late carries the momentum it would have had — the paper's, for momentum SGD whose momentum
   lives here (`optim=sgd optim.momentum=0 compression.dgc_momentum=0.9`); μ = 0 (the default) skips it and
   the masking below;
3. the two-phase top-k exchange with its worker residual (DGC's accumulation v ← v + u) and server residual;
4. **momentum factor masking**: u ← 0 where the accumulation was sent (its residual is exactly zero: top-k
   sends exact values), so a sent element's stale momentum does not push it again;
5. **sparsity warm-up**: the density sent grows sparser exponentially, from 1 (dense) at the first step to
   `compression.fraction` after `compression.sparsity_warmup_steps` steps: fraction^(t / steps).

With μ > 0 the exchanged value is a velocity that already holds DGC's momentum, and AdamW's β₁ averages it
again: two momenta in series, which cost 0.4–1.1 points of eval loss on three gpt-tiny configurations
(docs/benchmarks/2026-11-30-compression-defaults.md) — hence μ = 0 by default.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid.compression.codecs import TopKCodec, TwoPhaseState, _residual, done, two_phase_mean
from hybrid.parallel import collectives as C


def density(step: int, fraction: float, warmup_steps: int) -> float:
    """The share of each chunk sent at `step` (from 0): fraction^(step / warmup_steps), then `fraction`."""
    if step >= warmup_steps:
        return fraction
    return fraction ** (step / warmup_steps)


@dataclass
class DGCState(TwoPhaseState):
    """Top-k's two-phase state plus DGC's: the velocity per bucket, the step, and the knobs."""

    fraction: float = 0.01
    momentum: float = 0.0
    clip: float = 0.0
    warmup_steps: int = 0
    step: int = 0
    velocity: dict[int, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "velocity": dict(self.velocity), "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.velocity, self.step = dict(sd["velocity"]), int(sd["step"])


def dgc_hook(st: DGCState, bucket):  # noqa: ANN001, ANN201  (DDP's hook signature: see hooks.run_hook)
    """Clip locally, fold into the velocity, top-k two-phase exchange at this step's density, mask the
    velocity where sent (see the module doc)."""
    buf, idx, n = bucket.buffer(), bucket.index(), C.size(st.group)
    if st.stream is not None:  # CUDA: the last exchange (its residuals, its masking) is done before we read them
        torch.cuda.current_stream(buf.device).wait_stream(st.stream)
    if n == 1:
        st.step += int(bucket.is_last())
        return done(buf)
    if st.clip > 0:
        buf.mul_(min(1.0, st.clip / math.sqrt(n) / (float(buf.norm()) + 1e-6)))
    if st.momentum > 0:
        u = _residual(st.velocity, idx, buf)
        buf.copy_(u.mul_(st.momentum).add_(buf))
    st.codec = TopKCodec(density(st.step, st.fraction, st.warmup_steps))
    fut = two_phase_mean(st, buf, idx)
    if st.momentum > 0 and st.error_feedback:
        with torch.cuda.stream(st.stream) if st.stream is not None else contextlib.nullcontext():
            st.velocity[idx].masked_fill_(st.worker[idx][: buf.numel()] == 0, 0.0)  # after the exchange wrote it
    st.step += int(bucket.is_last())
    return fut
