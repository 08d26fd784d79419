"""DiLoCo and local SGD: DP replicas train alone for H steps, then agree through one outer step.

Every `sync.inner_steps` (H) optimizer steps, each replica's pseudo-gradient Δ = θ_anchor − θ (how far its H
inner steps moved it from the parameters every replica held after the last outer step, the anchor) is
averaged over the outer group — DP, or only between nodes under `sync.scope=inter` — through the DP
compression hook (`hook(state, bucket) -> Future` over flat fp32 buckets: the same codecs, error feedback and
byte counts as gradient sync, so `compression=int8` makes the outer exchange int8). The outer optimizer, SGD
with momentum μ (DiLoCo: Nesterov, lr 0.7, μ 0.9), then steps from the anchor,

    m ← μ·m + Δ̄;   θ_anchor ← θ_anchor − lr·(Δ̄ + μ·m)  (Nesterov)  or  − lr·m,

and every replica takes the new anchor as its parameters. With lr 1 and μ 0 that is the replicas' average
(`sync=local_sgd`). Under `train.precision=bf16_params` the outer step runs on the fp32 main weights.

Streaming (`sync.fragments=F`, Streaming DiLoCo): the parameters fall into F fragments of about equal size,
contiguous in the model's order (each fragment's buckets are `assign_buckets`'s of its parameters: with F=1 the
gradient sync's buckets, so a codec's exchange costs what one of its gradient steps does). Fragment f has its
outer steps at the steps ≡ ⌊(f+1)·H/F⌋ (mod H): each syncs every H steps, but the exchanges are spread over
the H steps, so the peak bytes of one step are 1/F.

Overlap (`sync.overlap_steps=τ`, Streaming DiLoCo's): a fragment's exchange starts after its step t (on groups
of its own, untimed while in flight) and the replicas go on training; after step t + τ it lands — the outer step
from the anchor on the Δ̄ of step t — and each replica's weights become α·(its own, τ steps further) +
(1 − α)·(the new anchor), α = `sync.overlap_mix` (0: the new anchor, the τ local steps of that fragment
dropped). The exchange hides behind τ steps of compute.

At the run's last step every exchange in flight lands on the anchor alone (the replicas keep their local steps
since), then every fragment takes one more exchange, blocking (the explicit final sync), so the run ends with
one model. The inner optimizer's state stays each replica's own.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Union

import torch
from torch import nn

from hybrid.config import SyncConfig
from hybrid.optim.adamw import counted_here
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.buckets import GradBucket, assign_buckets
from hybrid.parallel.dp.data import CommHook, write_back
from hybrid.parallel.params import param_info
from hybrid.sync.outer_policy import OuterPolicy
from hybrid.sync.replica import Weights, load_replica_state, over_ranks, replica_state

Means = dict[nn.Parameter, torch.Tensor]
Launched = Union[tuple[list[GradBucket], list[Any]], Means]
"""An outer exchange in flight: its buckets (this rank's share of Δ) and the hook's futures (None: one rank); or,
once waited for (a checkpoint), its result Δ̄ per parameter."""


def fragments_of(params: list[nn.Parameter], n: int) -> list[list[nn.Parameter]]:
    """`params` cut into `n` contiguous fragments of about equal element counts (some may be empty: every stage
    keeps all n, so fragment f has its outer steps on the same steps everywhere); a pipeline-tied embedding copy
    always in the first, so that both stages' copies take their outer steps together."""
    parts = [0 if _tied(p) else i for p, i in zip(params, even_parts([p.numel() for p in params], n))]
    return [[p for p, part in zip(params, parts) if part == f] for f in range(n)]


def even_parts(sizes: list[int], n: int) -> list[int]:
    """The part (of `n` contiguous parts of about equal sums) of each of `sizes`, in order: an item goes where its
    middle element falls."""
    total, seen, out = max(sum(sizes), 1), 0, []
    for size in sizes:
        out.append(min(n - 1, (2 * seen + size) * n // (2 * total)))
        seen += size
    return out


def largest_share(sizes: list[int], n: int) -> int:
    """The most elements one of `n` ranks holds when `sizes` are split by `even_parts` (the outer exchange's
    share of a rank under `sync.scope=inter`)."""
    parts = even_parts(sizes, n)
    return max(sum(s for s, part in zip(sizes, parts) if part == i) for i in range(n))


def _tied(p: nn.Parameter) -> bool:
    info = param_info(p)
    return info.pp_tied or info.pp_duplicate


class OuterSync:
    """The outer loop of one rank: anchors, momentum, the fragments' exchanges and outer steps.

    `params`: the rank's trained parameters in the model's order; `group`: the group the pseudo-gradients are
    averaged over; `hook`, `state`: the DP compression hook; `weights`: the inner optimizer; `share`: under
    `sync.scope=inter` the node's DP ranks, which hold one replica between them — each exchanges its share of
    each fragment (about 1/r of its elements, contiguous, r = their count) between nodes, and they combine the
    averages (an all-reduce inside the node: a sum with zeros elsewhere, exact), so a node sends the model once;
    `tied_group`: the stages holding a tied embedding's copies, whose averages are averaged once more (a lossy
    codec rounds each stage's bucket on its own); `policy`: the outer step (`outer_policy`: pinned, or the auto
    rule, whose cosine sums over `model_groups`, TP then PP; its H is the run's)."""

    def __init__(self, cfg: SyncConfig, policy: OuterPolicy, params: list[nn.Parameter], group: Group,
                 hook: CommHook, state: Any, weights: Weights, bucket_mb: float = 25.0,
                 apart: frozenset[int] = frozenset(), share: Group = None, tied_group: Group = None,
                 model_groups: tuple[Group, Group] = (None, None)) -> None:
        self.cfg, self.group, self.hook, self.state, self.weights = cfg, group, hook, state, weights
        self.share, self.tied_group, self.model_groups, self.policy = share, tied_group, model_groups, policy
        self.h, self.tp_rank = policy.h, C.rank(model_groups[0])
        self.fragments = fragments_of(params, cfg.fragments)
        r, me = C.size(share), C.rank(share)
        mine = [[p for p, i in zip(f, even_parts([q.numel() for q in f], r)) if i == me] for f in self.fragments]
        self.buckets = [assign_buckets(f, int(bucket_mb * 2**20), apart) if f else [] for f in mine]
        self.events, self.bytes, self.last_step = 0, 0, 0
        self.restart()

    def restart(self, step: int = 0) -> None:
        """Anchor every fragment at the parameters held now; momentum zero (a run's start, or a resume at `step`
        whose checkpoint holds no outer state for this layout); an exchange in flight is waited for and dropped."""
        self.settle()
        self.anchor = {p: self.weights.main_weight(p).detach().float().clone() for f in self.fragments for p in f}
        self.device = next(iter(self.anchor.values())).device if self.anchor else torch.device("cpu")
        self.momentum = {p: torch.zeros_like(a) for p, a in self.anchor.items()} if self.policy.buffers else {}
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # the round's Δ̄·m, ‖Δ̄‖², ‖m‖²
        self.synced = [step] * len(self.fragments)  # the step of each fragment's last outer exchange
        self.pending: dict[int, tuple[int, Launched]] = {}  # fragment → (its launch step, the exchange in flight)

    def offset(self, f: int) -> int:
        """The step (mod H) of fragment `f`'s outer steps."""
        return (f + 1) * self.h // len(self.fragments) % self.h

    def due(self, step: int, last: bool) -> list[int]:
        """The fragments whose outer step follows optimizer step `step` (counted from 1); at the run's `last`
        step, every fragment trained since its last one."""
        return [f for f in range(len(self.fragments)) if self.fragments[f]
                and (step % self.h == self.offset(f) or (last and self.synced[f] < step))]

    def settle(self) -> None:
        """Wait for every exchange in flight (collective: the same on every rank), keeping its result to land on
        its step."""
        for f, (at, launched) in getattr(self, "pending", {}).items():
            if not isinstance(launched, dict):
                self.pending[f] = (at, self._means(f, *launched))

    def after_step(self, step: int, last: bool = False) -> list[int]:
        """The outer exchanges due after optimizer step `step`; the fragments synced. Collective over the outer group
        when one is due (the same steps on every rank). With `sync.overlap_steps=τ` an exchange launched here lands
        τ steps later. The last step lands every one in flight on the anchor only (the replica keeps its local
        steps since), then every fragment's final exchange blocks: the run ends with one model. Under the auto outer
        step a round's end (its last fragment landed) also decides it: 3 numbers all-reduced over TP and PP."""
        landed = [f for f, (at, _) in self.pending.items() if last or step == at + self.cfg.overlap_steps]
        for f in landed:
            self._land(f, *self.pending.pop(f), mix=1.0 if last else self.cfg.overlap_mix)
        due = self.due(step, last)
        for f in due:
            with C.TIMER.detached() if self.cfg.overlap_steps and not last else nullcontext():
                self.pending[f] = (step, self._launch(f))  # in flight across steps: its landing's wait is timed
            self.synced[f] = self.last_step = step
        for f in [f for f in due if last or not self.cfg.overlap_steps]:
            self._land(f, *self.pending.pop(f), mix=0.0)
        if self.policy.decides(step, last):
            self.policy.decide(step, self._cosine())
        if landed or due:
            self.weights.loaded()
        return due

    def _launch(self, f: int) -> Launched:
        """Start averaging fragment `f`'s pseudo-gradient Δ = θ_anchor − θ through the hook: this rank's share
        of it in buckets (numbered after the earlier fragments', so a hook's per-bucket state never mixes two
        fragments) and their futures."""
        first = sum(len(b) for b in self.buckets[:f])
        before = C.COUNTER.group_bytes(C.group_name(self.group))
        out, futures = [], []
        for i, ps in enumerate(self.buckets[f]):
            buf = torch.cat([(self.anchor[p] - self.weights.main_weight(p).float()).reshape(-1) for p in ps])
            out.append(GradBucket(first + i, buf, ps, is_last=i == len(self.buckets[f]) - 1))
            futures.append(self.hook(self.state, out[-1]) if C.size(self.group) > 1 else None)
        self.bytes += C.COUNTER.group_bytes(C.group_name(self.group)) - before
        return out, futures

    def _land(self, f: int, step: int, launched: Launched, mix: float) -> None:
        """Fragment `f`'s exchange launched at `step` completes: Δ̄, the outer step from the anchor, and each
        weight set to α·(its own) + (1 − α)·(the new anchor), α = `mix`."""
        means = launched if isinstance(launched, dict) else self._means(f, *launched)
        for p in self.fragments[f]:
            if _tied(p) and C.size(self.tied_group) > 1:
                C.all_reduce(means[p], self.tied_group)
                means[p].div_(C.size(self.tied_group))
            if self.policy.auto and counted_here(p, self.tp_rank):
                self._measure(means[p], self.momentum[p])
            self._apply(p, means[p], self.weights.main_weight(p), mix)
        self.events += 1

    def _means(self, f: int, buckets: list[GradBucket], futures: list[Any]) -> Means:
        """Δ̄ of each parameter of fragment `f`: the hook's results written back, then the node's shares combined
        (`share`)."""
        with C.TIMER.waiting(C.group_name(self.group)):
            for bucket, fut in zip(buckets, futures):
                if fut is not None:
                    write_back(bucket, fut.wait())
        means = {p: view for b in buckets for p, view in zip(b.parameters(), b.gradients())}
        if C.size(self.share) == 1:
            return means
        size = sum(p.numel() for p in self.fragments[f])
        node = GradBucket(-1, torch.zeros(size, device=self.device), self.fragments[f], False)
        for p, view in zip(node.parameters(), node.gradients()):
            if p in means:
                view.copy_(means[p])
        C.all_reduce(node.buffer(), self.share)  # every other rank's share is zeros there: the sum is exact
        return dict(zip(node.parameters(), node.gradients()))

    @torch.no_grad()
    def _measure(self, mean: torch.Tensor, last: torch.Tensor) -> None:
        """Add Δ̄·m, ‖Δ̄‖², ‖m‖² of one parameter to the round's sums (m: the last Δ̄ while averaging)."""
        a, b = mean.reshape(-1), last.reshape(-1)
        self.sums += torch.stack([a.dot(b), a.dot(a), b.dot(b)]).double()

    def _cosine(self) -> float:
        """The round's cos(Δ̄ₖ, Δ̄ₖ₋₁) over the whole model (NaN when either is zero), and the sums cleared.
        Collective over TP, then PP (3 numbers), where they have more than one rank: every rank gets one value."""
        for g in self.model_groups:
            if C.size(g) > 1:
                C.all_reduce(self.sums, g)
        dot, a2, b2 = self.sums.tolist()
        self.sums.zero_()
        return dot / math.sqrt(a2 * b2) if a2 * b2 > 0 else math.nan

    @torch.no_grad()
    def _apply(self, p: nn.Parameter, mean: torch.Tensor, weight: torch.Tensor, mix: float) -> None:
        """The outer SGD step of `p` from its anchor (the policy's lr and momentum now), and the replica's weight
        set to the new anchor (mixed with its own by `mix`). Averaging under the auto rule keeps Δ̄ as `m`."""
        (lr, mu), update = self.policy.step(), mean
        if p in self.momentum:
            m = self.momentum[p].mul_(mu).add_(mean) if mu else self.momentum[p].copy_(mean)
            if mu:
                update = mean.add(m, alpha=mu) if self.cfg.nesterov else m
        self.anchor[p].sub_(update, alpha=lr)
        if mix == 0:
            weight.copy_(self.anchor[p])
        elif mix < 1:
            weight.mul_(mix).add_(self.anchor[p].to(weight.dtype), alpha=1 - mix)

    def record(self, steps: int) -> dict[str, float]:
        """The metrics record's sync keys: outer steps so far (fragments' counted apart), the step of the last,
        and the outer exchanges' bytes per training step so far (`steps`: steps this process ran), the mean over
        ranks. Collective (the mean's uncounted all-reduce)."""
        return {"sync_events": self.events, "sync_last_step": self.last_step,
                "bytes_outer_per_step": over_ranks([self.bytes / max(steps, 1)], self.device)[0]}

    def state_dict(self) -> dict[str, Any]:
        """What differs between replicas (`replica_state`) and the outer state: the anchors, the momentum, the
        fragments' steps, and the exchanges in flight — waited for (collective then), their results saved to land
        on their step after a resume as they would have."""
        params = [p for f in self.fragments for p in f]
        self.settle()
        pending = [(f, at, [means[p] for p in self.fragments[f]]) for f, (at, means) in sorted(self.pending.items())]
        return {**replica_state(self.weights, params), "anchor": [self.anchor[p] for p in params],
                "momentum": [self.momentum[p] for p in params] if self.momentum else [], "pending": pending,
                "synced": list(self.synced), "events": self.events, "bytes": self.bytes, "last_step": self.last_step,
                **({"outer_sums": self.sums.clone()} if self.policy.auto else {})}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (the same layout: the same parameters in the same order)."""
        params = [p for f in self.fragments for p in f]
        load_replica_state(self.weights, params, sd)
        for p, a in zip(params, sd["anchor"]):
            self.anchor[p].copy_(a)
        for p, m in zip(params, sd["momentum"]) if self.momentum else ():  # none kept now: plain averaging pinned
            self.momentum[p].copy_(m)
        self.synced, self.events, self.bytes = list(sd["synced"]), int(sd["events"]), int(sd["bytes"])
        self.last_step = int(sd["last_step"])
        if "outer_sums" in sd:
            self.sums.copy_(sd["outer_sums"])
        self.settle()
        self.pending = {f: (at, {p: m.to(self.device) for p, m in zip(self.fragments[f], means)})
                        for f, at, means in sd.get("pending", [])}
        self.weights.loaded()
