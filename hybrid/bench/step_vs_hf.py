"""hybrid's training step at one rank vs a plain PyTorch loop on transformers' GPT2LMHeadModel.

Same model (our weights copied into GPT2LMHeadModel with `to_hf_state_dict`), same data
(synthetic uniform tokens of the model's vocabulary, the same samples in the same order from
one `StepSampler` each), same dtype (fp32), same thread count, same AdamW hyperparameters,
no-decay grouping, LR schedule and grad-norm clipping. The two run side by side in one
process, interleaved AB BA AB… over `--repeats` rounds; each round runs `--warmup` untimed then
`--steps` timed steps per side. Reported: median tokens/s of each, their ratio
(hybrid / reference, goal ≥ 1.0×) and the first- and last-step losses of both (same weights
and data, so they agree to float rounding).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.step_vs_hf [--model gpt-tiny] [--threads 1 2]

hybrid side: `Trainer.train_step` with `ParallelContext.single()` and the default exact
hook (microbatches, GradSync no-op at dp=1, global grad norm, clipping, AdamW, LR).
Reference side: for each microbatch `model(input_ids=x, labels=y, shift_labels=y)` (transformers'
own loss with the labels already shifted, so both models see the same S input tokens and
predict the same S tokens), `loss / m` backward; then `clip_grad_norm_`, AdamW (foreach, as
ours), `zero_grad`. Attention: transformers' "sdpa" implementation (ours calls SDPA too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from hybrid.bench.model_size import model_names
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, ConfigError, compose_config
from hybrid.data import Corpus
from hybrid.model import analytic_param_count, build_model
from hybrid.model.hf import hf_config, to_hf_state_dict
from hybrid.optim import lr_at, param_groups
from hybrid.parallel.context import ParallelContext
from hybrid.record.metrics import format_count, model_flops_per_token
from hybrid.sampler import StepSampler, batch_from
from hybrid.trainer import Trainer
from hybrid.validation import validate

ATTN_IMPL = "sdpa"
CPU = torch.device("cpu")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The benchmark's command line (defaults: gpt-tiny, 1024-token steps, 1 and 2 threads, ~1 minute)."""
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.step_vs_hf", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny", help="a configs/model name of the gpt family")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side before each round's timing")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts, one row each")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds (hybrid, reference) per thread count")
    p.add_argument("--seed", type=int, default=1234, help="weights, data and sample order")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the config's train.lr)")
    p.add_argument("--compile", action="store_true", help="hybrid with train.compile=true (the reference eager)")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "micro_batch", "microbatches", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.model not in model_names():
        p.error(f"unknown --model {args.model}; configs/model has {', '.join(model_names())}")
    if args.warmup < 0 or min(args.threads) < 1:
        p.error("--warmup must be >= 0 and --threads >= 1")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this measurement, every setting spelled out."""
    threads = " ".join(str(t) for t in args.threads)
    return (f"OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.step_vs_hf --model {args.model} "
            f"--steps {args.steps} --warmup {args.warmup} --threads {threads} --seq-len {args.seq_len} "
            f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} --repeats {args.repeats}"
            + (f" --seed {args.seed}" if args.seed != 1234 else "")
            + (f" --lr {args.lr}" if args.lr is not None else "")
            + (" --compile" if args.compile else ""))


def bench_config(args: argparse.Namespace) -> Config:
    """The composed, validated config: one process, fp32 on CPU, the benchmark's batch shape, no eval."""
    total = args.repeats * len(args.threads) * (args.warmup + args.steps)
    cfg = compose_config([
        f"model={args.model}", "parallel=single", f"data.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch * args.microbatches}",
        f"train.steps={total}", "train.eval_every=0", "train.precision=fp32", "train.device=cpu",
        f"train.seed={args.seed}", *([f"train.lr={args.lr}"] if args.lr is not None else []),
        f"train.compile={str(args.compile).lower()}",
    ])
    if cfg.model.family != "gpt":
        raise ConfigError(f"model={args.model} is {cfg.model.family}; this benchmark compares the gpt family "
                          "against GPT2LMHeadModel")
    validate(cfg, world_size=1)
    return cfg


def synthetic_corpus(vocab: int, seq_len: int, n: int, seed: int) -> Corpus:
    """`n` samples of `seq_len + 1` uniform random tokens in [0, vocab)."""
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, vocab, size=(n + 1, seq_len + 1), dtype=np.int64).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples[:n], eval=samples[n:], seq_len=seq_len)


class ReferenceLoop:
    """A plain PyTorch training loop on transformers' GPT2LMHeadModel, hyperparameters as `cfg`; on CUDA with
    bf16 autocast (`autocast`) and AdamW's fused kernel, as a PyTorch user would write it there."""

    def __init__(self, cfg: Config, model: torch.nn.Module, corpus: Corpus, device: torch.device = CPU,
                 autocast: bool = False) -> None:
        self.cfg, self.model, self.corpus, self.device = cfg, model.to(device), corpus, device
        t, o = cfg.train, cfg.optim
        self.num_microbatches = t.global_batch_size // t.micro_batch_size
        kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=t.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, **kernel)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
        self.sampler = StepSampler(len(corpus.train), t.micro_batch_size, self.num_microbatches, 1, 0, t.seed)
        self.step = 0

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The model's mean loss on one microbatch (transformers' own, the labels already shifted)."""
        return self.model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss

    def train_step(self) -> float:
        """One optimizer step over the microbatches; returns the mean loss (read back: a host sync)."""
        return float(self.run_step())

    def run_step(self) -> torch.Tensor:
        """One optimizer step over the microbatches; the mean loss stays on the device."""
        t, o = self.cfg.train, self.cfg.optim
        lr = lr_at(self.step, t.lr, t.steps, o.warmup_steps, o.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        total = torch.zeros((), device=self.device)
        for idx in self.sampler.next_step():
            x, y = (t.to(self.device) for t in batch_from(self.corpus.train, idx))
            with self.autocast:
                loss = self.loss(x, y) / self.num_microbatches
            loss.backward()
            total += loss.detach()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total


def build_sides(cfg: Config, corpus: Corpus, device: torch.device = CPU) -> tuple[Trainer, ReferenceLoop]:
    """hybrid's single-rank Trainer and the reference loop on `device`, starting from the same weights; the
    reference runs under bf16 autocast when hybrid computes in bf16 (`train.precision` bf16 or bf16_params)."""
    from transformers import GPT2LMHeadModel

    ctx = ParallelContext.single()
    model = build_model(cfg.model, corpus.vocab_size, ctx.tp_group, seed=cfg.train.seed)
    hf = GPT2LMHeadModel(hf_config(cfg.model, corpus.vocab_size, attn_implementation=ATTN_IMPL))
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg.model, corpus.vocab_size), strict=True)
    if hf.config._attn_implementation != ATTN_IMPL:
        raise RuntimeError(f"transformers chose attention {hf.config._attn_implementation!r}, not {ATTN_IMPL!r}")
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, model.to(device), corpus, device, hook, state)
    return trainer, ReferenceLoop(cfg, hf, corpus, device, autocast=cfg.train.precision.startswith("bf16"))


@dataclass
class Side:
    """One contender: its step function, the tokens/s of each round (wall and CPU time) and every step's loss."""

    name: str
    step: Callable[[], float]
    rates: list[float] = field(default_factory=list)
    cpu_rates: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def round(self, warmup: int, steps: int, tokens: int) -> None:
        """`warmup` untimed steps, then `steps` timed ones; records this round's tokens/s."""
        for _ in range(warmup):
            self.losses.append(self.step())
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.losses.append(self.step())
        self.cpu_rates.append(steps * tokens / (time.process_time() - cpu))
        self.rates.append(steps * tokens / (time.perf_counter() - wall))


@dataclass
class Row:
    """One thread count's result: median tokens/s of each side and the per-round (paired) ratios."""

    threads: int
    hybrid: float  # median tokens/s (wall clock)
    reference: float
    round_ratios: list[float]  # hybrid / reference of each round, wall clock
    cpu_ratios: list[float]  # the same on process CPU time (less sensitive to other processes' load)

    @property
    def ratio(self) -> float:
        """Median of the paired per-round ratios (robust to load drifting between rounds)."""
        return statistics.median(self.round_ratios)

    @property
    def cpu_ratio(self) -> float:
        """Median of the paired per-round CPU-time ratios."""
        return statistics.median(self.cpu_ratios)


def _ratios(a: list[float], b: list[float]) -> list[float]:
    """Element-wise a / b."""
    return [x / y for x, y in zip(a, b)]


def measure(hybrid: Side, reference: Side, args: argparse.Namespace, tokens: int) -> list[Row]:
    """Interleave the two sides over `args.repeats` rounds for each thread count (hybrid first in even rounds)."""
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        k = len(hybrid.rates)
        for i in range(args.repeats):
            for side in (hybrid, reference) if i % 2 == 0 else (reference, hybrid):  # ABBA: no side always first
                side.round(args.warmup, args.steps, tokens)
        h, r = hybrid.rates[k:], reference.rates[k:]
        rows.append(Row(threads, statistics.median(h), statistics.median(r), _ratios(h, r),
                        _ratios(hybrid.cpu_rates[k:], reference.cpu_rates[k:])))
    return rows


def header(cfg: Config, trainer: Trainer, args: argparse.Namespace, tokens: int) -> str:
    """Start-up lines: the model's size against the analytic formula, and what is compared."""
    import transformers

    m, vocab = cfg.model, trainer.corpus.vocab_size
    n, analytic = trainer.n_params, analytic_param_count(m, vocab)
    flops = model_flops_per_token(analytic, m.n_layers, m.hidden, args.seq_len)
    return "\n".join([
        f"model {m.name}: {format_count(n)} parameters ({n}; analytic {analytic}, match: {n == analytic}), "
        f"{flops / 1e9:.4f} GFLOP/token = 6N + 12·L·h·s (s={args.seq_len}; counted N gives "
        f"{trainer.report.flops_per_token / 1e9:.4f}, match: {trainer.report.flops_per_token == flops})",
        f"data: synthetic uniform tokens, vocab {vocab}; step = {args.microbatches} microbatches × "
        f"{args.micro_batch} seqs × {args.seq_len} tokens = {tokens} tokens; fp32; "
        f"{args.repeats} rounds × ({args.warmup} warmup + {args.steps} timed) steps per side",
        f"reference: transformers {transformers.__version__} GPT2LMHeadModel, attn_implementation={ATTN_IMPL!r}, "
        f"same weights; torch {torch.__version__}",
    ])


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def table(rows: list[Row], flops_per_token: float) -> str:
    """The result table: medians of each side, the paired ratio and its range over rounds."""
    lines = ["threads| hybrid tok/s | reference tok/s | hybrid/ref | min..max rounds | CPU-time ratio | hybrid GFLOP/s",
             "-------|--------------|-----------------|------------|-----------------|----------------|---------------"]
    for r in rows:
        span = f"{min(r.round_ratios):.3f}..{max(r.round_ratios):.3f}"
        lines.append(f"{r.threads:7d}| {r.hybrid:12.1f} | {r.reference:15.1f} | {r.ratio:9.3f}× | {span:15s} | "
                     f"{r.cpu_ratio:13.3f}× | {r.hybrid * flops_per_token / 1e9:14.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Build both sides, measure, print the table; returns rows and losses (for tests)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = bench_config(args)
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    tokens = args.micro_batch * args.microbatches * args.seq_len
    corpus = synthetic_corpus(vocab, args.seq_len, max(256, 8 * args.micro_batch * args.microbatches), args.seed)
    trainer, ref = build_sides(cfg, corpus)
    out(header(cfg, trainer, args, tokens))
    load = os.getloadavg()[0]
    hybrid = Side("hybrid", lambda: trainer.train_step().loss)
    reference = Side("reference", ref.train_step)
    rows = measure(hybrid, reference, args, tokens)
    out(table(rows, trainer.report.flops_per_token))
    out(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; 1-min load average {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after (load above the thread count = other processes shared the cores: "
        "trust the paired ratios, not the absolute rates)")
    h, r = hybrid.losses, reference.losses
    out(f"loss, first step: hybrid {h[0]:.6f}  reference {r[0]:.6f}  |Δ| {abs(h[0] - r[0]):.2e}; "
        f"last step ({len(h)}): hybrid {h[-1]:.6f}  reference {r[-1]:.6f}  |Δ| {abs(h[-1] - r[-1]):.2e}")
    out(f"reproduce: {reproduce_command(args)}")
    return {"rows": rows, "hybrid_losses": h, "reference_losses": r}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
