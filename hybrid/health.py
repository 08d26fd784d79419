"""Health checks of a long run: a straggler named, replicas that drifted apart caught, communication watched.

**Stragglers** (`health.straggler_every` steps, `health.straggler_threshold`). Each rank adds up its compute
time (forward, backward and weight passes: `PipelineStats.busy_s`, the bubble and communication excluded);
every N steps one all-gather over the world shares the sums. Ranks are compared with the others of their
pipeline stage (stages do different work: the last one holds the head), or with every rank when each stage
is a single rank. A rank more than the threshold above its group's median is named in a warning line, and
every record carries `health/straggler_ratio` (the slowest rank's time over its group's median) and
`health/slowest_rank`: one slow GPU, a throttled node or a noisy neighbour slows everyone through the
collectives, and this says which.

**Replica divergence** (`health.divergence_every` steps). Data-parallel replicas must hold bit-identical
parameters after each step, and so must the TP ranks for the parameters TP replicates (norms, row-parallel
biases). Every N steps each rank fingerprints its parameters (two float64 sums per tensor, one position-weighted,
so any changed bit or moved element shows), all-gathers them over its DP group and, for the TP-replicated ones,
its TP group, and compares exactly. A mismatch — silent data corruption, a sync bug, a rank that skipped an
update — stops the run on every rank (a world all-reduce of the verdict) with one line naming the parameter
and the ranks that disagree (`ReplicaDivergence`, exit 1). Under ZeRO-1 with overlapped parameter gathers the
gathers are waited for first.

**Communication** (`health.comm_*`, `self.comm`): each group's bus bandwidth and exposed time against the run's
own baseline, checked on the timed logged steps (`hybrid.comm_watch`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.comm_watch import CommWatch
from hybrid.config import HealthConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.params import param_info


class ReplicaDivergence(RuntimeError):
    """Replicas that must be identical are not: one line naming the parameter and the ranks (exit 1)."""


class HealthMonitor:
    """The straggler and divergence checks of one rank (see the module doc); every rank calls `after_step`."""

    def __init__(self, cfg: HealthConfig, ctx: ParallelContext, model: nn.Module, say: Callable[[str], None],
                 settle: Optional[Callable[[], None]] = None, replicas: Optional[dist.ProcessGroup] | str = "dp"
                 ) -> None:
        self.cfg, self.ctx, self.say, self.settle = cfg, ctx, say, settle
        self.replicas = ctx.dp_group if replicas == "dp" else replicas  # DP ranks equal after every step (`sync`)
        chunks = model if isinstance(model, nn.ModuleList) else [model]  # a chunk's names are the global ones
        self.named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad]
        self.device = self.named[0][1].device if self.named else torch.device("cpu")  # NCCL: CUDA tensors
        self.busy: list[Callable[[], float]] = []  # each step's compute seconds since the last check, unread
        self.steps, self.latest = 0, {}
        self.comm = CommWatch(cfg, ctx.layout, say, lambda values: _gather_rows(values, self.device, ctx))

    def after_step(self, step: int, busy_s: Callable[[], float]) -> None:
        """Account step `step`'s compute (`busy_s()` its seconds, read only at a check: on CUDA a read waits for
        the step's events, which a step that checks nothing must not); run the checks that are due. Collective
        when one is due."""
        self.steps += 1
        if self.cfg.straggler_every:
            self.busy.append(busy_s)
        if self.cfg.straggler_every and step % self.cfg.straggler_every == 0:
            self.latest = self.stragglers(step)
        if self.cfg.divergence_every and step % self.cfg.divergence_every == 0:
            self.divergence(step)

    def record(self) -> dict[str, Any]:
        """The latest straggler figures for metrics.jsonl ({} before the first check)."""
        return dict(self.latest)

    def stragglers(self, step: int) -> dict[str, Any]:
        """Share the compute seconds since the last check (one all-gather over the world); warn about the slowest
        rank of any group when it is more than the threshold above the group's median."""
        busy = sum(seconds() for seconds in self.busy)
        times = [row[0] for row in _gather_rows([busy], self.device, self.ctx)]
        n, self.steps, self.busy = max(self.steps, 1), 0, []
        worst = max(_compare(times, self.ctx), key=lambda x: x[0])
        ratio, rank, median = worst
        if ratio > 1 + self.cfg.straggler_threshold:
            c = self.ctx.layout.coord(rank)
            self.say(f"warning: straggler: rank {rank} (pp {c.pp}, dp {c.dp}, tp {c.tp}) computed {ratio:.2f}× the "
                     f"median of its {'stage' if self.ctx.layout.world > self.ctx.layout.pp else 'run'} over steps "
                     f"{step - n + 1}..{step} ({times[rank] / n:.3f} s against {median / n:.3f} s per step; "
                     f"health.straggler_threshold={self.cfg.straggler_threshold:g})")
        return {"health/straggler_ratio": ratio, "health/slowest_rank": rank}

    def divergence(self, step: int) -> None:
        """Compare the fingerprints of what must be identical over DP and TP; raise ReplicaDivergence on every
        rank when any group disagrees (three collectives: the DP and TP all-gathers, a world all-reduce)."""
        if self.settle is not None:
            self.settle()  # ZeRO-1's parameter all-gathers still in flight
        replicated = [(n, p) for n, p in self.named if param_info(p).tp_duplicate]
        found = [self._mismatch("dp", self.replicas, self.named),  # both collectives on every rank
                 self._mismatch("tp", self.ctx.tp_group, replicated)]
        found = next((f for f in found if f), None)
        flag = torch.tensor([1.0 if found else 0.0], device=self.device)
        if dist.is_initialized() and self.ctx.layout.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise ReplicaDivergence(f"replica divergence after step {step}: " + (
                found or "found on another rank (its line names the parameter); this rank's replicas agree"))

    def _mismatch(self, kind: str, group: Optional[dist.ProcessGroup], named: list) -> Optional[str]:
        """The line for the first parameter whose fingerprint differs over `group`, or None."""
        if C.size(group) == 1 or not named:
            return None
        mine = torch.stack([fingerprint(p) for _, p in named])
        everyone = [torch.empty_like(mine) for _ in range(C.size(group))]
        dist.all_gather(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        everyone = [t.cpu() for t in everyone]
        for i, (name, _) in enumerate(named):
            values = [tuple(t[i].tolist()) for t in everyone]
            if len(set(values)) > 1:
                return f"{name} differs over the {kind} group (ranks {ranks}): {_odd(ranks, values)}"
        return None


def _odd(ranks: list[int], values: list[tuple]) -> str:
    """Who drifted: the ranks outside the majority's values, when there is a strict majority."""
    common = max(set(values), key=values.count)
    if 2 * values.count(common) <= len(values):
        return "no majority, so which replica drifted cannot be told (silent data corruption or a sync bug)"
    odd = [r for r, v in zip(ranks, values) if v != common]
    return f"rank(s) {odd} hold other values than the rest (silent data corruption or a sync bug)"


def fingerprint(p: torch.Tensor) -> torch.Tensor:
    """Two float64 sums of `p`'s values, plain and weighted by position: equal tensors give equal sums (the
    same reduction on the same device), a changed value or a moved one almost surely does not."""
    x = p.detach().reshape(-1).double()
    ramp = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), (x * ramp).sum()])


def _gather_rows(values: list[float], device: torch.device, ctx: ParallelContext) -> list[list[float]]:
    """Every rank's `values`, by rank (one all-gather over the world; metrics only, uncounted)."""
    if not dist.is_initialized() or ctx.layout.world == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(ctx.layout.world)]
    dist.all_gather(out, t)
    return [x.tolist() for x in out]


def _compare(times: list[float], ctx: ParallelContext) -> list[tuple[float, int, float]]:
    """(time over its group's median, rank, that median) of each group's slowest rank: the ranks of one pipeline
    stage form a group, or all ranks when each stage is a single one."""
    layout = ctx.layout
    stages = [[r for r in range(layout.world) if layout.coord(r).pp == s] for s in range(layout.pp)]
    groups = stages if min(map(len, stages)) > 1 else [list(range(layout.world))]
    out = []
    for ranks in groups:
        median = statistics.median(times[r] for r in ranks)
        slowest = max(ranks, key=lambda r: times[r])
        out.append((times[slowest] / median if median > 0 else 1.0, slowest, median))
    return out
