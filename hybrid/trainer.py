"""The training step and loop.

One step: the rank's microbatches run through the pipeline schedule (`parallel.schedule`; with
pp=1 it is plain forward/backward per microbatch), each loss scaled by 1/microbatches so
gradients sum to the mean over the global batch; `GradSync` has meanwhile launched each DP
bucket's comm hook as soon as that bucket's gradients were final; `finalize_grads` waits for
them and sums the tied embedding and the sequence-parallel replicated gradients; then
`optimizer.step(lr)` (the LR for this step, the global gradient norm, clipping, AdamW) and
`grad_sync.zero_grad()`. The loss lives on the last pipeline stage and is broadcast over PP for the metrics.
Eval runs every `train.eval_every` steps on the held-out split, forward-only through the pipeline.

The Trainer owns its run state (`state_dict`: the step and the sampler's position), its
`Checkpointer` (fed the model, the optimizer, itself and the DP hook's state) and, once `start`
has loaded what the run resumes from, its metrics logger.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.checkpoint import Checkpointer
from hybrid.checkpoint.files import scan
from hybrid.checkpoint.resume import pretrained
from hybrid.config import Config
from hybrid.data import Corpus
from hybrid.health import HealthMonitor
from hybrid.memory import meta_stages, micro_of, training_schedule
from hybrid.model import build_model
from hybrid.model.context_parallel import ContextParallel
from hybrid.nonfinite import Guard
from hybrid.optim import lr_at, to_low_precision
from hybrid.parallel import collectives as C
from hybrid.parallel.clocks import clock_for
from hybrid.parallel.context import ParallelContext, pp_streams
from hybrid.parallel.cp.sharding import shard
from hybrid.parallel.dp.data import CommHook, finalize_grads
from hybrid.parallel.params import count_params
from hybrid.parallel.pp.actions import part_of
from hybrid.parallel.pp.pipeline import P2P, PipelineStats, partition_layers, run_schedule
from hybrid.parallel.pp.schedules import SCHEDULES, Schedule, build_schedule
from hybrid.parallel.timeouts import Timeouts
from hybrid.parallel.tp.comm import TPOverlap
from hybrid.record import comm_env
from hybrid.record.profiling import StepProfiler
from hybrid.record.report import StepReport, StepResult
from hybrid.record.runlog import Tally, gather, open_metrics, peak_memory, summary, summary_line, write_summary
from hybrid.record.sinks import MetricsLogger
from hybrid.sampler import StepSampler, batch_from, eval_indices
from hybrid.sync import build_plan

if TYPE_CHECKING:
    import numpy as np


def build_chunks(cfg: Config, vocab: int, ctx: ParallelContext) -> nn.ModuleList:
    """This rank's model chunks: for each chunk c the part of the pp·v parts the schedule places there
    (c·pp + pp_rank, or the V's; one chunk without interleaving; the whole model at pp=1). Only these
    parameters are ever built."""
    p = cfg.parallel
    parts = partition_layers(cfg.model.n_layers, ctx.pp_size * p.virtual_stages, p.stage_layers)
    chunks = []
    for c in range(p.virtual_stages):
        s = part_of(SCHEDULES[p.schedule].placement, ctx.pp_size, ctx.pp_rank, c)
        chunks.append(build_model(cfg.model, vocab, ctx.tp_group, layers=parts[s], pre=s == 0,
                                  post=s == len(parts) - 1, seed=cfg.train.seed,
                                  sequence_parallel=p.sequence_parallel))
        chunks[-1].set_recompute(cfg.train.recompute)
        chunks[-1].set_compile(cfg.train.compile, cfg.train.compile_scope, cfg.train.compile_mode)
        chunks[-1].set_context_parallel(ContextParallel(ctx.cp_group, p.cp_comm) if ctx.cp_size > 1 else None)
        chunks[-1].set_fused_head(cfg.train.fused_head, cfg.train.head_chunk)
        chunks[-1].set_tp_overlap(TPOverlap(p.tp_overlap, p.tp_overlap_chunks))
    return nn.ModuleList(chunks)


class Trainer:
    """Holds the model chunks, the DP plan (gradient sync, optimizer, replica-level sync: `hybrid.sync`), the
    schedule, sampler, checkpointer and metrics of one rank. `hook`, `hook_state`: a DP comm hook to run instead
    of `compression=`'s. `log` takes the trainer's lines (rank 0's checkpoint saves, resumes, notes) until
    `start` opens the metrics logger; by default they are held and shown then."""

    def __init__(self, cfg: Config, ctx: ParallelContext, model: nn.Module, corpus: Corpus,
                 device: torch.device, hook: Optional[CommHook] = None, hook_state: Any = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.cfg, self.ctx, self.corpus, self.device = cfg, ctx, corpus, device
        self.model = model if isinstance(model, nn.ModuleList) else nn.ModuleList([model])
        t = cfg.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * ctx.dp_size)
        low = t.precision == "bf16_params"  # Megatron-style: bf16 parameters, fp32 main weights and gradients
        main = to_low_precision(self.model) if low else None
        self.dp = build_plan(cfg, ctx, self.model, main, (hook, hook_state) if hook is not None else None)
        self.grad_sync, self.optimizer = self.dp.grad_sync, self.dp.optimizer
        self.grad_sync.begin_step(self.num_microbatches)
        self.activation_dtype = torch.bfloat16 if low else torch.float32  # the residual stream's, between stages
        self.sampler = StepSampler(len(corpus.train), t.micro_batch_size, self.num_microbatches, ctx.dp_size,
                                   ctx.dp_rank, t.seed)
        self.schedule = self._schedule(self.num_microbatches)
        self.p2p = self._p2p()
        C.TIMER.clock = clock_for(device)
        self.stats = PipelineStats(C.TIMER.clock)  # compute marks of the last step (measured bubble)
        self.metrics: Optional[MetricsLogger] = None  # opened by `start`
        self._held: list[str] = []
        self._say = log or self._held.append
        self.step = 0
        self.tally = Tally(self.step)  # the summary's sink; `start` makes it again at the step it resumes
        bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        self._microbatches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.n_params = count_params(self.model.parameters(), ctx.tp_rank, (ctx.tp_group, ctx.pp_group))  # TP, PP
        self.report = StepReport(cfg, ctx, self.grad_sync, device, self.n_params, corpus.seq_len, self.message)
        self.profiler = StepProfiler(cfg.profile, ctx.rank, device, self.message)
        self.timeouts = Timeouts(cfg.parallel.timeout_s, cfg.parallel.train_timeout_s)
        self.checkpointer = Checkpointer(cfg, ctx, device, self.checkpoint_states(),
                                         tokenizer=getattr(corpus, "tokenizer", None), log=self.message)
        self.guard = Guard(t, ctx, self.checkpointer, self.message, self.dp.same_norm,  # train.on_nonfinite
                           self.dp.hook_state, deferred=self.dp.verdict_on_device)
        self.health = HealthMonitor(cfg.health, ctx, self.model, self.message, getattr(self.optimizer, "wait_params",
                                                                                      None), self.dp.replicas_group)

    def checkpoint_states(self) -> dict[str, Any]:
        """What a checkpoint of this trainer holds (the `Checkpointer`'s states)."""
        return {"model": self.model, "trainer": self, **self.dp.checkpoint_states()}

    def state_dict(self) -> dict[str, Any]:
        """The run's position, the same on every rank: steps done, samples consumed, the data order's seed,
        and the DP plan's run-level decisions (under `compression.schedule=auto` the schedule's; layout-independent)."""
        self.guard.verify()  # a checkpoint never holds a state past a non-finite step not yet read
        sampler = self.sampler.state_dict()
        return {"step": self.step, "consumed_samples": sampler["consumed_samples"], "data_seed": sampler["seed"],
                **self.guard.state_dict(), **self.dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict({"consumed_samples": state["consumed_samples"], "seed": state["data_seed"]})
        self.guard.load_state_dict(state)
        self.dp.load_state_dict(state)

    def message(self, line: str) -> None:
        """One line of the run's log (printed by rank 0): through the metrics logger once it exists."""
        if self.metrics is not None:
            self.metrics.message(line)
        else:
            self._say(line)

    def start(self, resume: Optional[tuple[Path, dict[str, Any]]] = None) -> MetricsLogger:
        """Before `fit`: load the checkpoint `resume` (`plan_resume`'s answer; one that cannot be read
        fails here, before anything is written) or else `model.init_from`, then open the metrics logger
        at the step reached and show the lines held meanwhile. Collective: the load's (DCP's plan exchange)."""
        init_from = self.cfg.model.init_from
        if resume:
            self.checkpointer.load(*resume)
            if init_from:
                self.message(f"note: model.init_from={init_from} ignored: resuming {resume[0]} wins")
        elif init_from:
            getattr(self.optimizer, "wait_params", lambda: None)()  # every parameter writable (ZeRO-3: gathered)
            self.message(pretrained(self.model, self.cfg.model))
            self.optimizer.reload_main()  # bf16 parameters: the main weights start from them
            self.dp.restart(self.step)  # DiLoCo's anchors, the servers' shards: from the loaded weights
        if note := self.profiler.skipped(self.step):
            self.message(note)
        self.tally = Tally(self.step)
        self.metrics = open_metrics(self.cfg, self.ctx.rank == 0, self.step, (self.tally,))
        for line in self._held:
            self.metrics.message(line)  # rank 0 only
        self._held.clear()
        return self.metrics

    def close(self) -> None:
        self.profiler.stop()  # a run that ends inside the profiled steps still writes its trace
        if self.metrics is not None:
            self.metrics.close()

    def summarize(self, wall_s: float, log: Optional[Path] = None) -> Optional[dict[str, Any]]:
        """After `fit`, on every rank: rank 0 writes summary.json (returned), closes its metrics, prints the line.
        Collective: one all_gather_object over the world (each rank's peak memory, the signal it caught)."""
        ranks = gather((peak_memory(self.device), self.checkpointer.preemption.caught))
        if self.ctx.rank != 0 or self.metrics is None:
            return None
        saved = [str(p) for s, p, ok in scan(self.checkpointer.root) if ok and s > self.tally.start_step]  # kept ones
        doc = summary(self.tally, (self.step, self.cfg.train.steps), wall_s, ranks, self.device, saved, log,
                      comm_env.communication(comm_env.backend()) | self.health.comm.summary())
        self.metrics.close(last_line=summary_line(write_summary(Path(self.cfg.logging.dir), doc)))
        return doc

    def _schedule(self, microbatches: int, forward_only: bool = False) -> Schedule:
        """The training schedule (`memory.training_schedule`: zero-bubble deferrals fitted to memory) or, for
        evaluation, the forwards of `parallel.schedule` (1f1b at pp=1: forward, backward per microbatch)."""
        p, layout = self.cfg.parallel, self.ctx.layout
        if not forward_only and SCHEDULES[p.schedule].split_backward and layout.pp > 1 and p.zb_memory != "none":
            vocab = self.cfg.model.vocab_size or self.corpus.vocab_size
            stages = meta_stages(layout, lambda c: build_chunks(self.cfg, vocab, c))
            return training_schedule(self.cfg, layout, stages, micro_of(self.cfg, self.device.type))
        name = p.schedule if self.ctx.pp_size > 1 else "1f1b"
        return build_schedule(name, self.ctx.pp_size, microbatches, p.virtual_stages, forward_only)

    def _p2p(self) -> Optional[P2P]:
        """Hidden states between stages: [micro batch, seq (or seq/tp under SP), hidden], in the residual
        stream's dtype (fp32, also under autocast; bf16 under bf16 parameters: half the bytes)."""
        if self.ctx.pp_size == 1:
            return None
        seq = self.corpus.seq_len // self.ctx.cp_size
        if self.cfg.parallel.sequence_parallel and self.ctx.tp_size > 1:
            seq //= self.ctx.tp_size
        shape = (self.cfg.train.micro_batch_size, seq, self.cfg.model.hidden)
        streams = pp_streams(self.ctx, self.schedule.streams)
        return P2P(self.ctx.pp_group, shape, self.activation_dtype, self.device, streams)

    def _batch(self, samples: np.ndarray, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (shard(t, self.ctx.cp_size, self.ctx.cp_rank) for t in batch_from(samples, idx))  # CP: its tokens
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def forward_step(self, chunk: int, mb: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        """The schedule's forward step: ids in on the first part, the mean loss out on the last."""
        module = self.model[chunk]
        ids, labels = self._microbatches[mb]
        with self.autocast():
            return module(ids if module.pre else x, labels if module.post else None)

    def _run(self, schedule: Schedule, samples: np.ndarray, indices: list[np.ndarray]) -> torch.Tensor:
        """Run `schedule` over the microbatches `indices`; the mean loss (on the last stage, else 0)."""
        start = C.TIMER.mark()
        self._microbatches = [self._batch(samples, idx) for idx in indices]
        C.TIMER.phase("data", start)
        self.stats = PipelineStats(C.TIMER.clock)
        try:
            losses = run_schedule(schedule, self.ctx.pp_rank, self.forward_step, self.p2p, self.stats)
        finally:
            self._microbatches = []
        for kind, a, b in self.stats.marks:
            C.TIMER.phase(kind, a, b)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.float() / len(indices)
        return total

    def train_step(self, timed: bool = False, due: bool = True) -> StepResult:
        """One optimizer step over this rank's microbatches of the global batch; `timed`: record where its
        time went (`C.TIMER`, kept by `self.report`). A step that is not `due` (nothing logged, saved or ended
        after it: the same steps on every rank) reads nothing from the device when the DP plan's optimizer
        refuses a non-finite step on the device: the host runs on into the next step's launches."""
        start = time.perf_counter()
        C.TIMER.begin_step(timed, self.step + 1)
        lr = lr_at(self.guard.lr_step(self.step), self.cfg.train.lr, self.cfg.train.steps, self.cfg.optim.warmup_steps,
                   self.cfg.optim.min_lr_ratio)
        self.model.train()
        with C.TIMER.timed_phase("data"):
            indices = list(self.sampler.next_step())
        total = self._run(self.schedule, self.corpus.train, indices)
        with C.TIMER.timed_phase("finalize"):
            finalize_grads(self.grad_sync, self.ctx.embedding_group, self.ctx.tp_group)
        loss = self.report.loss(total, self.schedule)  # on every rank, on the device
        with C.TIMER.timed_phase("optimizer"):
            norm = self.optimizer.step(lr)  # updates nothing when the norm is not finite
            self.guard.inspect(norm, self.model, self.step + 1, loss, due)
            self.grad_sync.zero_grad()
        self.step += 1
        self.dp.after_step(self.step, last=self.step == self.cfg.train.steps)  # collective when due
        if due or timed:
            self.dp.synchronize(self.device)  # the step's time is the device's
        self.report.timed(C.TIMER.end_step(), self.schedule, self.stats)
        self.health.after_step(self.step, lambda stats=self.stats: stats.busy_s)  # collective when a check is due
        return StepResult(loss, norm, lr, time.perf_counter() - start)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `train.eval_batches` held-out global batches: the same sequences for any layout."""
        self.model.eval()
        t = self.cfg.train
        batches = eval_indices(len(self.corpus.eval), t.micro_batch_size, self.ctx.dp_size, self.ctx.dp_rank,
                               t.eval_batches * self.num_microbatches)
        total = self._run(self._schedule(len(batches), forward_only=True), self.corpus.eval, list(batches))
        self.model.train()
        return float(self.report.loss(total, self.schedule))

    def step_metrics(self, r: StepResult) -> dict[str, Any]:
        """The metrics.jsonl record of a step (`StepReport.record`; collective), with the compression stage
        the step ran (`Compression.record`) and the steps skipped so far (`Guard.record`)."""
        stage = self.dp.stage_record(self.step) | self.guard.record()
        stage |= self.health.record() | self.dp.replica_record(self.step - self.tally.start_step)
        seconds = self.report.window.take(r.step_time_s)  # the mean since the last logged step
        record = {**self.report.record(self.step, r.loss, r.grad_norm, r.lr, seconds), **stage}
        return record | self.health.comm.check(self.step, record, self.report.timing)  # collective on an alert

    def _logs(self, step: int) -> bool:
        """Whether step `step` (counted from 1) writes a metrics record."""
        return step % self.cfg.logging.log_every == 0 or step == self.cfg.train.steps

    def _due(self, step: int) -> bool:
        """Whether step `step` must read its figures from the device: it is logged, checkpointed or the last
        (a save on a signal reads them then: `Guard.verify`). The same answer on every rank."""
        return self._logs(step) or self.checkpointer.due(step)

    def _meters(self, step: int) -> bool:
        """Whether logged step `step` meters the compression error (`compression.measure_every`)."""
        every = self.cfg.logging.log_every * self.cfg.compression.measure_every
        return step % every == 0 or step == self.cfg.train.steps

    def fit(self) -> Optional[StepResult]:
        """Train to `train.steps` (from `self.step`, which a resume sets), logging every `logging.log_every`
        steps, evaluating every `train.eval_every` and checkpointing every `checkpoint.every`. A signal of
        `checkpoint.save_on_signal` ends the run at the next step boundary, on every rank, after saving
        that step (`Checkpointer.save_on_signal`: one all_reduce per step while any such signal is set)."""
        with self.checkpointer.preemption:  # the signals' handlers only set a flag, read at step boundaries
            last = self._steps()
        self.checkpointer.wait()  # an async save still in flight completes before the run ends
        return last

    def _steps(self) -> Optional[StepResult]:
        """`fit`'s loop: steps until `train.steps`, or until the step a signal's save ends with."""
        t, last = self.cfg.train, None
        while self.step < t.steps:
            C.COUNTER.reset()
            logs = self._logs(self.step + 1)
            self.grad_sync.meter(logs and self._meters(self.step + 1))  # ‖ĝ − g‖ on a sample of them
            self.profiler.before_step(self.step + 1)
            last = self.train_step(timed=logs and self.cfg.logging.timing, due=self._due(self.step + 1))
            self.report.window.add(last.step_time_s, alone=self.step == self.tally.start_step + 1)
            if self.guard.settle(self, last):  # a non-finite step: stopped, skipped or rewound
                continue
            if switch := self.dp.observe(self.step, lambda r=last: r.loss):
                self.message(switch)  # the auto schedule's decision, the same on every rank
            self.profiler.after_step(self.step)
            if self._logs(self.step):
                record = self.step_metrics(last)  # on every rank: the bytes are averaged over ranks
                if self.metrics is not None:
                    self.metrics.log(self.step, record)
                if self.step == t.steps and self.cfg.logging.traffic_map and self.ctx.layout.world > 1:
                    self.report.traffic(self.step, self.message)  # before eval adds its own p2p bytes
            elif self.metrics is not None:
                self.metrics.update_progress(self.step)
            self.timeouts.training()  # parallel.train_timeout_s from here on; an eval or a save: timeout_s
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                with self.timeouts.relaxed():
                    eval_loss = self.evaluate()
                if self.metrics is not None:
                    self.metrics.log_eval(self.step, eval_loss)
            with self.timeouts.relaxed(self.checkpointer.due(self.step) or bool(self.checkpointer.preemption.caught)):
                self.checkpointer.after_step(self.step)
                signal = self.checkpointer.save_on_signal(self.step)
            if signal:
                break
        return last

