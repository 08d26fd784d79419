"""The GPU check's measurements (`hybrid.bench.gpucheck`): one single-rank training run per model and setting,
the CUDA path against the CPU, and hybrid beside a plain transformers loop."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hybrid.bench.step_vs_hf import build_sides, synthetic_corpus
from hybrid.cli import UsageError
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.memory import largest_micro_batch, meta_stages, stage_estimates
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.record.metrics import mfu, peak_flops
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import PRECISIONS, validate

if TYPE_CHECKING:
    from hybrid.bench.gpucheck import Plan

SAMPLES = 256
SDPA_OPS = (("flash_attention_for_cpu", "flash (cpu)"), ("cudnn", "cudnn"), ("efficient", "efficient"),
            ("flash", "flash"), ("math", "math"))
"""aten::_scaled_dot_product_<kind>… op names → the backend, most specific first."""


@dataclass(frozen=True)
class Setting:
    """How a run computes: `train.precision` and `train.compile`."""

    precision: str
    compile: bool

    def __str__(self) -> str:
        return f"{self.precision}{' +compile' if self.compile else ''}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """`PRECISION` or `PRECISION+compile` (e.g. `bf16_params+compile`); anything else is bad input."""
        precision, plus, rest = text.partition("+")
        if precision not in PRECISIONS or (plus and rest != "compile"):
            raise UsageError(f"--settings: {text!r} is not PRECISION[+compile] with PRECISION one of "
                             f"{', '.join(PRECISIONS)}")
        return cls(precision, bool(plus))


def config(model: str, setting: Setting, device: torch.device, seq_len: int, micro: int, steps: int,
           extra: Sequence[str] = ()) -> Config:
    """One rank, two microbatches of `micro` × `seq_len`, no eval, `extra` overrides last; validated."""
    cfg = compose_config([f"model={model}", "parallel=single", f"data.seq_len={seq_len}",
                          f"train.micro_batch_size={micro}", f"train.global_batch_size={2 * micro}",
                          f"train.steps={steps}", "train.eval_every=0", f"train.precision={setting.precision}",
                          f"train.compile={str(setting.compile).lower()}", f"train.device={device.type}", *extra])
    validate(cfg, world_size=1)
    return cfg


def vocab_of(cfg: Config) -> int:
    return cfg.model.vocab_size or cfg.data.vocab_size


def estimate(cfg: Config, device: torch.device, micro: int | None = None) -> int:
    """`hybrid.memory`'s total for the one rank (its chunks built on the meta device)."""
    layout = Layout(world=1)
    stages = meta_stages(layout, lambda ctx: build_chunks(cfg, vocab_of(cfg), ctx))
    return stage_estimates(cfg, layout, stages, device.type, micro)[0].total


def fitting_micro(plan: Plan, model: str, setting: Setting) -> int:
    """The plan's micro batch, or the largest the estimate fits in the GPU's memory (less 10 %)."""
    cfg = config(model, setting, plan.device, plan.seq_len, plan.micro_batch, 1)
    if plan.device.type != "cuda":
        return plan.micro_batch
    layout = Layout(world=1)
    stages = meta_stages(layout, lambda ctx: build_chunks(cfg, vocab_of(cfg), ctx))
    memory = int(0.9 * torch.cuda.get_device_properties(plan.device).total_memory)
    return max(1, min(plan.micro_batch, largest_micro_batch(cfg, layout, stages, "cuda", memory)))


def trainer(cfg: Config, device: torch.device) -> Trainer:
    """A single-rank Trainer of `cfg` on `device` over seeded synthetic tokens."""
    ctx = ParallelContext.single()
    model = build_chunks(cfg, vocab_of(cfg), ctx).to(device)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    corpus = synthetic_corpus(vocab_of(cfg), cfg.data.seq_len, SAMPLES, cfg.train.seed)
    return Trainer(cfg, ctx, model, corpus, device, hook, state)


def sdpa_backend(t: Trainer) -> str:
    """The attention kernel one training-mode forward runs, read from the profiler's op names."""
    from torch.profiler import profile

    ids = torch.as_tensor(t.corpus.train[: t.cfg.train.micro_batch_size, :-1]).long().to(t.device)
    with profile() as prof, torch.no_grad(), t.autocast():
        t.model[0](ids)
    names = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    found = [label for key, label in SDPA_OPS if any(key in n for n in names)]
    return found[0] if found else "none seen"


def timed(step: Any, device: torch.device, steps: int) -> float:
    """Seconds for `steps` calls of `step`, the GPU's queue drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - start


def measure(plan: Plan, model: str, setting: Setting) -> dict[str, Any]:
    """One run: warm-up, timed steps, tokens/s, MFU, peak memory against the estimate, SDPA's backend."""
    micro = fitting_micro(plan, model, setting)
    cfg = config(model, setting, plan.device, plan.seq_len, micro, plan.warmup + plan.steps)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(plan.device)
    t = trainer(cfg, plan.device)
    losses = [user_step(t) for _ in range(plan.warmup)]
    seconds = timed(lambda: losses.append(user_step(t)), plan.device, plan.steps)
    tokens = plan.steps * 2 * micro * plan.seq_len / seconds
    peak = torch.cuda.max_memory_allocated(plan.device) if plan.device.type == "cuda" else None
    return {"micro_batch": micro, "tokens_per_s": tokens, "step_s": seconds / plan.steps,
            "mfu": mfu(tokens, t.report.flops_per_token, 1, peak_flops(plan.device)), "peak_bytes": peak,
            "estimate_bytes": estimate(cfg, plan.device), "sdpa": sdpa_backend(t), "losses": [float(x) for x in losses],
            "log_every": cfg.logging.log_every}


def user_step(t: Trainer) -> torch.Tensor:
    """One step as `Trainer.fit` runs it (`Trainer._due`, fit's own rule): the device's figures read only on a
    step that logs (every `logging.log_every`, and the last) or saves, so the host queues on ahead of the GPU in
    between; the loss stays on the device until the timing ends."""
    return t.train_step(due=t._due(t.step + 1)).loss_t


def cuda_matches_cpu(device: torch.device) -> dict[str, Any]:
    """Two fp32 steps of a small GPT on `device` and on the CPU from the same weights and data: the losses
    agree within 1e-4 relative (TF32 matmuls on the GPU round more than the CPU)."""
    cfg = config("gpt-tiny", Setting("fp32", False), device, 32, 2, 2)
    cfg.model.n_layers = 2
    ours, cpu = trainer(cfg, device), trainer(cfg, torch.device("cpu"))
    pairs = [(ours.train_step().loss, cpu.train_step().loss) for _ in range(2)]
    return {"ok": all(abs(a - b) <= 1e-4 * abs(b) for a, b in pairs), "losses": pairs}


def side_by_side(plan: Plan, model: str) -> dict[str, Any]:
    """hybrid (bf16_params) and the transformers loop (bf16 autocast, SDPA, fused AdamW), same weights and data,
    rounds alternating; the median of the per-round ratios of tokens/s."""
    setting = Setting("bf16_params", False)
    micro = fitting_micro(plan, model, setting)
    cfg = config(model, setting, plan.device, plan.seq_len, micro, plan.rounds * 2 * (1 + plan.steps))
    corpus = synthetic_corpus(vocab_of(cfg), plan.seq_len, SAMPLES, cfg.train.seed)
    ours, ref = build_sides(cfg, corpus, plan.device)
    steps = {"hybrid": lambda: ours.train_step().loss, "reference": ref.train_step}
    rates: dict[str, list[float]] = {"hybrid": [], "reference": []}
    tokens = plan.steps * 2 * micro * plan.seq_len
    for i in range(plan.rounds):
        for name in ("hybrid", "reference") if i % 2 == 0 else ("reference", "hybrid"):
            steps[name]()  # untimed
            rates[name].append(tokens / timed(steps[name], plan.device, plan.steps))
    ratios = [a / b for a, b in zip(rates["hybrid"], rates["reference"])]
    return {"micro_batch": micro, "hybrid_tokens_per_s": statistics.median(rates["hybrid"]),
            "reference_tokens_per_s": statistics.median(rates["reference"]), "ratio": statistics.median(ratios),
            "round_ratios": ratios}
