"""What a logged step reports, and the run's traffic map.

`StepReport` turns a step into its metrics.jsonl record: loss, throughput and MFU; the bytes per group
counted at the collectives; the DP figures of `GradSync` (bytes, compression ratio and error) and, for a
lossy exchange, each bucket's error and rank or density (`hybrid.record.error_budget`); and, when
the step was timed (`logging.timing`), the `comm/` and `time/` keys of `hybrid.record.comm_report`.
All of it comes from one float64 all-reduce over the world (metrics only, uncounted), its elements in a
fixed order (gloo's ring sums each element in an order set by its position).

`traffic` sums every rank's row of the step's bytes rank → rank (`hybrid.record.traffic_map`) over the
world (one more all-reduce, once per run) and rank 0 writes `traffic.json` and `traffic.png`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.config import Config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.data import GradSync
from hybrid.parallel.pp.pipeline import PipelineStats, schedule_idle_s
from hybrid.parallel.pp.schedules import Schedule
from hybrid.parallel.timing import StepTiming
from hybrid.record import comm_report, traffic_map
from hybrid.record.error_budget import ErrorBudget
from hybrid.record.metrics import model_flops_per_token, peak_flops


@dataclass
class StepResult:
    """A step's figures. The loss and the gradient norm stay on the device (`loss_t`, `norm_t`) until read:
    `loss` and `grad_norm` are host reads (on CUDA they wait for the step), made only where a figure is asked."""

    loss_t: torch.Tensor
    norm_t: torch.Tensor
    lr: float
    step_time_s: float

    @property
    def loss(self) -> float:
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.norm_t)


class StepWindow:
    """The steps since the last logged one. A logged step reports their mean time, so its tokens/s covers the
    window: between logged steps the host runs ahead of the device and the logged step's wait pays for them all.
    A step added `alone` (the first of a start: it pays for warm-up) is a window of its own, dropped unless logged."""

    def __init__(self) -> None:
        self.seconds, self.steps, self.alone = 0.0, 0, False

    def add(self, seconds: float, alone: bool = False) -> None:
        if self.alone:
            self.take(0.0)
        self.seconds, self.steps, self.alone = self.seconds + seconds, self.steps + 1, alone

    def take(self, fallback: float) -> float:
        """The window's mean step time (`fallback`: no step added, e.g. a step run outside `fit`); a new window."""
        mean = self.seconds / self.steps if self.steps else fallback
        self.seconds, self.steps, self.alone = 0.0, 0, False
        return mean


class StepReport:
    """The record of a logged step on one rank (every rank builds it: the sums are collective)."""

    def __init__(self, cfg: Config, ctx: ParallelContext, grad_sync: GradSync, device: torch.device,
                 n_params: int, seq_len: int, say: Callable[[str], None] = print) -> None:
        self.cfg, self.ctx, self.grad_sync, self.device, self.seq_len = cfg, ctx, grad_sync, device, seq_len
        self.say = say  # the run's log (rank 0 prints)
        self.diverged_at: Optional[int] = None  # the first logged step whose loss was NaN or inf
        m = cfg.model
        self.flops_per_token = model_flops_per_token(n_params, m.n_layers, m.hidden, seq_len)
        self.peak = peak_flops(device)
        self.timing: Optional[list[float]] = None  # the last timed step's `comm_report.local_vector`
        self.window = StepWindow()  # the step times since the last logged step
        lossy = cfg.compression.method != "none" and ctx.dp_size > 1 and not grad_sync.report.exact
        self.budget = ErrorBudget(ctx.pp_rank, ctx.pp_size) if lossy else None  # per-bucket compression figures

    def loss(self, t: torch.Tensor, schedule: Schedule) -> torch.Tensor:
        """A step's (or an eval's) mean loss on every rank, on the device (no host read): broadcast over PP from
        the rank holding the last part, then averaged over CP and DP (metrics only: uncounted, not training traffic)."""
        ctx = self.ctx
        if ctx.pp_size > 1:
            with C.TIMER.collective(C.group_name(ctx.pp_group), "loss"):
                dist.broadcast(t, group=ctx.pp_group, group_src=schedule.last_rank)
        for group in (ctx.cp_group, ctx.dp_group):  # each CP rank's loss is over its tokens: the mean of equal shares
            if C.size(group) > 1:
                t = t.clone()
                with C.TIMER.collective(C.group_name(group), "loss"):
                    dist.all_reduce(t, group=group)
                t /= C.size(group)
        return t

    def timed(self, t: Optional[StepTiming], schedule: Schedule, stats: PipelineStats) -> None:
        """Keep the step's timing vector (None: the step was not timed), with the schedule's own idle
        time for this rank from its measured compute."""
        if t is None:
            self.timing = None
            return
        m = schedule.microbatches
        weight = sum(stats.weight_s) / m
        idle = schedule_idle_s(schedule, self.ctx.pp_rank, sum(stats.forward_s) / m, sum(stats.backward_s) / m + weight,
                               weight if stats.weight_s else None)
        self.timing = comm_report.local_vector(t, C.COUNTER, idle)

    def mean_bytes(self) -> dict[str, float]:
        """This step's bytes per group averaged over all ranks (stages send different amounts), the DP
        figures `GradSync` reports and, for a timed step, the `comm/` and `time/` keys. One all-reduce
        over the world: every rank calls it on logging steps."""
        count, world = C.COUNTER, self.ctx.layout.world
        dp, *dp_rest = self.grad_sync.local_metrics()
        values = [count.group_bytes("tp"), count.group_bytes("pp"), dp, count.group_bytes("embedding"),
                  count.group_bytes("cp"), *dp_rest]
        budget = self._budget_vector()
        n, b = len(values), len(values) + len(budget)
        t = torch.tensor([float(v) for v in values + budget + (self.timing or [])], dtype=torch.float64,
                         device=self.device)
        if world > 1:
            dist.all_reduce(t)  # metrics only: uncounted, not training traffic
        (tp, pp, dp, embedding, cp, *dp_rest), timing = t[:n].tolist(), t[b:].tolist()
        sync = self.grad_sync.metrics([dp, *dp_rest], world)
        sync |= self.budget.record(t[n:b].tolist()) if self.budget is not None else {}
        comm = comm_report.record(timing, world, self.ctx.layout.group_sizes()) if timing else {}
        return {"bytes_tp": tp / world, "bytes_pp": pp / world, "bytes_dp": sync.pop("bytes_dp"),
                "bytes_embedding": embedding / world, **({"bytes_cp": cp / world} if self.ctx.cp_size > 1 else {}),
                **sync, **comm}

    def _budget_vector(self) -> list[float]:
        """The error budget's slots of this rank (`hybrid.record.error_budget`); none for an exact exchange."""
        if self.budget is None:
            return []
        return self.budget.vector(self.grad_sync.bucket_figures(), len(self.grad_sync.buckets), self.device)

    def record(self, step: int, loss: float, grad_norm: float, lr: float, step_time_s: float) -> dict[str, Any]:
        """The metrics.jsonl record of a step. Collective (see `mean_bytes`). The first non-finite loss
        also gets a warning line: such a state is not saved (`Checkpointer.save`)."""
        if not math.isfinite(loss) and self.diverged_at is None:
            self.diverged_at = step
            self.say(f"warning: the loss is {loss} at step {step}: training diverged (a lower train.lr, or "
                     "optim.grad_clip, may help); a non-finite state is never checkpointed")
        tokens = self.cfg.train.global_batch_size * self.seq_len
        tps = tokens / step_time_s
        flops = tps * self.flops_per_token / self.ctx.layout.world  # achieved per rank
        out = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
               "step_time_s": step_time_s, **self.mean_bytes(), "gflops_per_rank": flops / 1e9}
        if self.peak:
            out["mfu"] = flops / self.peak
        return out

    def traffic(self, step: int, say: Callable[[str], None]) -> dict[str, Any]:
        """The step's traffic map (the counter's bytes, rank → rank, per group), summed over the world by
        one all-reduce; rank 0 writes it into the run folder. Collective: every rank calls it."""
        layout, rank = self.ctx.layout, self.ctx.rank
        flat = traffic_map.placed(traffic_map.rows(layout, rank, C.COUNTER), rank, layout.world)
        t = torch.tensor(flat, dtype=torch.float64, device=self.device)
        if layout.world > 1:
            dist.all_reduce(t)  # metrics only: uncounted
        doc = {"unit": "bytes per step", "step": step, "world": layout.world,
               "node_of": [layout.node(r) for r in range(layout.world)],
               "matrices": traffic_map.matrices(t.tolist(), layout.world)}
        if rank == 0:
            write_traffic(doc, Path(self.cfg.logging.dir), say)
        return doc


def write_traffic(doc: dict[str, Any], run_dir: Path, say: Callable[[str], None]) -> None:
    """traffic.json, and traffic.png of the total; optional outputs, so a failure is a note (rank 0 alone
    writes: raising here would strand the other ranks in their next collective). The heat map's module is
    imported here, not at the top: matplotlib loads only on the step that draws."""
    from hybrid.diagnostics.heatmap import write_heatmap

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "traffic.json").write_text(json.dumps(doc))
        write_heatmap(doc["matrices"]["total"], str(run_dir / "traffic.png"), "bytes sent per step, rank → rank",
                      "bytes", doc["node_of"], row_label="sender rank", col_label="receiver rank")
    except (OSError, ValueError) as e:  # an optional picture: never stop the run for it
        say(f"note: traffic map not written: {e}")
