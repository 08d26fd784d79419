"""The training step and loop.

One step: the rank's microbatches run forward and backward (each loss scaled by
1/microbatches, so gradients sum to the mean over the global batch); `GradSync` has
meanwhile launched each DP bucket's comm hook as soon as that bucket's gradients were final;
`finish()` waits for them; under sequence parallelism the replicated parameters' partial
gradients are summed over TP (one all-reduce); then the global gradient norm (counted once across TP/PP), clipping,
the LR for this step and AdamW. Eval runs every `train.eval_every` steps on the held-out split.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.data import Corpus, StepSampler, batch_from, eval_indices
from hybrid.metrics import MetricsLogger, model_flops_per_token, peak_flops
from hybrid.optim import build_optimizer, clip_grads, global_grad_norm, lr_at
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.data import GradSync
from hybrid.parallel.tensor import sync_sequence_parallel_grads


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float


class Trainer:
    """Holds the model, optimizer, gradient sync, sampler and metrics of one rank."""

    def __init__(self, cfg: Any, ctx: ParallelContext, model: torch.nn.Module, corpus: Corpus,
                 device: torch.device, hook: Any, hook_state: Any, metrics: Optional[MetricsLogger] = None) -> None:
        self.cfg, self.ctx, self.model, self.corpus, self.device = cfg, ctx, model, corpus, device
        t = cfg.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * ctx.dp_size)
        self.optimizer = build_optimizer(model, cfg.optim, t.lr)
        self.grad_sync = GradSync(list(model.parameters()), ctx.dp_group, hook, hook_state, cfg.parallel.bucket_mb)
        self.grad_sync.begin_step(self.num_microbatches)
        self.sampler = StepSampler(len(corpus.train), t.micro_batch_size, self.num_microbatches, ctx.dp_size,
                                   ctx.dp_rank, t.seed)
        self.metrics = metrics
        self.step = 0
        bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        self.n_params = self.count_params()  # collective over TP and PP: every rank computes it here, once
        m = cfg.model
        self.flops_per_token = model_flops_per_token(self.n_params, m.n_layers, m.hidden, corpus.seq_len)
        self.peak = peak_flops(device)

    def count_params(self) -> int:
        """Parameters of the whole model: local counts summed over TP (shards) and PP (stages)."""
        local = sum(p.numel() for p in self.model.parameters()
                    if not getattr(p, "pp_duplicate", False) and (not p.tp_duplicate or self.ctx.tp_rank == 0))
        n = torch.tensor(float(local))
        for g in (self.ctx.tp_group, self.ctx.pp_group):
            if C.size(g) > 1:
                dist.all_reduce(n, group=g)  # start-up bookkeeping, not training traffic
        return int(n.item())

    def _batch(self, samples: Any, idx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch_from(samples, idx)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self) -> StepResult:
        """One optimizer step over this rank's microbatches of the global batch."""
        start = time.perf_counter()
        lr = lr_at(self.step, self.cfg.train.lr, self.cfg.train.steps, self.cfg.optim.warmup_steps,
                   self.cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        total = torch.zeros((), device=self.device)
        for idx in self.sampler.next_step():
            x, y = self._batch(self.corpus.train, idx)
            with self.autocast():
                loss = self.model(x, y) / self.num_microbatches
            loss.backward()
            total += loss.detach().float()
        self.grad_sync.finish()
        params = self.grad_sync.parameters()
        sync_sequence_parallel_grads(params, self.ctx.tp_group)
        norm = global_grad_norm(params, self.ctx)
        clip_grads(params, self.cfg.optim.grad_clip, norm)
        self.optimizer.step()
        self.grad_sync.zero_grad()
        self.step += 1
        loss_value = self._dp_mean(total)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(loss_value, float(norm), lr, time.perf_counter() - start)

    def _dp_mean(self, t: torch.Tensor) -> float:
        """Mean of a scalar over DP ranks (metrics only: uncounted, not gradient traffic)."""
        if C.size(self.ctx.dp_group) > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.ctx.dp_group)
            t /= self.ctx.dp_size
        return float(t)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `train.eval_batches` held-out global batches: the same sequences for any layout."""
        self.model.eval()
        t = self.cfg.train
        batches = eval_indices(len(self.corpus.eval), t.micro_batch_size, self.ctx.dp_size, self.ctx.dp_rank,
                               t.eval_batches * self.num_microbatches)
        total = torch.zeros((), device=self.device)
        for idx in batches:
            x, y = self._batch(self.corpus.eval, idx)
            with self.autocast():
                total += self.model(x, y).float()
        self.model.train()
        return self._dp_mean(total / len(batches))

    def step_metrics(self, r: StepResult) -> dict[str, Any]:
        """The metrics.jsonl record of a step (bytes are this rank's, counted at the collectives)."""
        tokens = self.cfg.train.global_batch_size * self.corpus.seq_len
        tps = tokens / r.step_time_s
        flops = tps * self.flops_per_token / self.ctx.layout.world  # achieved per rank
        out = {"step": self.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tps,
               "step_time_s": r.step_time_s, "bytes_tp": C.COUNTER.group_bytes("tp"),
               "bytes_pp": C.COUNTER.group_bytes("pp"), "bytes_dp": C.COUNTER.group_bytes("dp"),
               "gflops_per_rank": flops / 1e9}
        if self.peak:
            out["mfu"] = flops / self.peak
        return out

    def fit(self) -> Optional[StepResult]:
        """Train to `train.steps`, logging every `logging.log_every` steps and evaluating periodically."""
        t, last = self.cfg.train, None
        while self.step < t.steps:
            C.COUNTER.reset()
            last = self.train_step()
            if self.metrics is not None:
                if self.step % self.cfg.logging.log_every == 0 or self.step == t.steps:
                    self.metrics.log(self.step, self.step_metrics(last))
                else:
                    self.metrics.update_progress(self.step)
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                eval_loss = self.evaluate()
                if self.metrics is not None:
                    self.metrics.log_eval(self.step, eval_loss)
        return last
