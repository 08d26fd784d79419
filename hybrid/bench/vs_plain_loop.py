"""hybrid's single-rank step beside a plain PyTorch loop of the same shape: tokens/s, GPU busy share, launches.

    python -m hybrid.bench.vs_plain_loop [--model gpt-1b] [--seq-len 1024] [--micro-batch 8] [--rounds 4]
    python -m hybrid.bench.vs_plain_loop --quick          # CPU, gpt-tiny: the overhead-bound regime

The contenders (`--sides`, the first is compared with each other one):
- `hybrid`: `Trainer.train_step` at `parallel=single`, `train.precision` from `--precision` (on CUDA
  default bf16_params; on CPU fp32), `hybrid_compiled` the same with `train.compile=true`;
- `plain`: a nanoGPT-style loop written here (`bench.plain_gpt.PlainGPT`: fp32 weights, bf16 autocast on
  CUDA, fused AdamW on CUDA / foreach on CPU, SDPA, `clip_grad_norm_`, the same LR schedule and data),
  `plain_compiled` the same model through `torch.compile` (whole model). Its loss stays on the device.
Both start from the same weights (hybrid's, converted) and read the same samples in the same order.

Rounds alternate the order of the sides (A B C, C B A, …): each round one untimed step then `--steps`
timed ones per side, the device drained before and after; reported is the median over rounds of each
side's tokens/s and of the paired per-round ratios. Then one profiled run of `--profile-steps` steps
per side gives, from the profiler's trace, the GPU busy share of the steps' wall time (the union of
kernel, copy and set intervals), kernel launches per step and, on CUDA, the device-to-host
synchronisations per step (`torch.cuda.set_sync_debug_mode`); on CPU the host time per step, the reads
of tensors into Python per step (`record.host_syncs`) and, in the launches' column, the aten ops a step
dispatches that compute (what would launch a kernel on a GPU; the norm, for one, is then multi-tensor).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.bench.common import add_quick, check_models, parse_with_quick, reproduce_command
from hybrid.bench.gpucheck_steps import Setting, config, timed, trainer, vocab_of
from hybrid.bench.plain_gpt import PlainGPT, hf_to_plain
from hybrid.bench.step_vs_hf import ReferenceLoop
from hybrid.model.hf import export_hf_state_dict
from hybrid.record.host_syncs import HostSyncs
from hybrid.record.metrics import mfu, peak_flops

SIDES = ("hybrid", "hybrid_compiled", "plain", "plain_compiled")
QUICK = {"model": "gpt-tiny", "seq_len": 128, "micro_batch": 2, "rounds": 4, "steps": 3, "profile_steps": 2}
GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNC_WARNING = "synchroniz"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.vs_plain_loop", description=__doc__.splitlines()[0])
    add_quick(p, "gpt-tiny at 128 tokens on the CPU")
    p.add_argument("--model", default="gpt-1b", help="a gpt-family model config")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per microbatch (two per step)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--precision", default=None, help="hybrid's train.precision (default: bf16_params on CUDA, "
                   "fp32 on CPU; the plain loop autocasts to bf16 whenever this is bf16*)")
    p.add_argument("--sides", default=None, help=f"comma-separated, from {','.join(SIDES)} (default: hybrid, "
                   "plain and plain_compiled on CUDA; hybrid and plain on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--hybrid", default="", help="config overrides for hybrid's sides, space-separated (e.g. "
                   "'train.compile_scope=model train.compile_mode=reduce-overhead train.fused_head=off')")
    p.add_argument("--out", type=Path, default=None, help="write every figure to this JSON file")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    resolve(p, args)
    return args


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the device-dependent defaults; refuse unknown sides and counts below 1 (parser error, exit 2)."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cuda", "cpu") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device}: this machine offers cpu{' and cuda' if torch.cuda.is_available() else ''}")
    cuda = args.device == "cuda"
    args.precision = args.precision or ("bf16_params" if cuda else "fp32")
    args.sides = args.sides or ("hybrid,plain,plain_compiled" if cuda else "hybrid,plain")
    sides = args.sides.split(",")
    if len(sides) < 2 or len(set(sides)) != len(sides) or any(s not in SIDES for s in sides):
        p.error(f"--sides must name two or more distinct sides of {','.join(SIDES)}")
    if min(args.seq_len, args.micro_batch, args.rounds, args.steps, args.profile_steps) < 1:
        p.error("--seq-len, --micro-batch, --rounds, --steps and --profile-steps must be >= 1")


@dataclass
class Side:
    """One contender: a step (its loss may stay on the device), per-round tokens/s, profile figures."""

    name: str
    step: Callable[[], Any]
    rates: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)


def hybrid_side(args: argparse.Namespace, compiled: bool) -> tuple[Side, Any]:
    """hybrid's Trainer at one rank; returns the side and the trainer (the plain loop copies its weights). Its
    steps are a run's steps that log nothing: the loss stays on the device, as the plain loop's does."""
    cfg = config(args.model, Setting(args.precision, compiled), torch.device(args.device), args.seq_len,
                 args.micro_batch, 10_000, args.hybrid.split())
    t = trainer(cfg, torch.device(args.device))
    side = Side("hybrid_compiled" if compiled else "hybrid", lambda: t.train_step(due=False).loss_t)  # on device
    return side, t


class PlainLoop(ReferenceLoop):
    """`ReferenceLoop`'s step (microbatches, clip, AdamW, LR) over `PlainGPT`, whose forward is the loss."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)


def plain_loop(args: argparse.Namespace, ours: Any) -> PlainLoop:
    """The plain loop on `ours`'s weights, data and hyperparameters (a `ReferenceLoop` over `PlainGPT`)."""
    cfg, vocab = ours.cfg, vocab_of(ours.cfg)
    model = PlainGPT(cfg.model, vocab)
    hf = export_hf_state_dict(ours.model[0], cfg.model, vocab)
    model.load_state_dict(hf_to_plain(hf, cfg.model.n_layers), strict=True)
    return PlainLoop(cfg, model, ours.corpus, ours.device, autocast=args.precision.startswith("bf16"))


def build(args: argparse.Namespace) -> tuple[list[Side], Any]:
    """Every side named by `--sides`, in that order, and hybrid's trainer. The plain sides share one model
    and optimizer (eager and compiled calls of it), started from hybrid's first weights."""
    wanted = args.sides.split(",")
    sides, base = {}, None
    for name in ("hybrid", "hybrid_compiled"):
        if name in wanted or base is None:
            side, t = hybrid_side(args, name == "hybrid_compiled")
            base = base or t
            sides[name] = side
    if "plain" in wanted or "plain_compiled" in wanted:
        loop = plain_loop(args, base)
        sides["plain"] = Side("plain", loop.run_step)
    if "plain_compiled" in wanted:  # torch.compile imports the compiler (seconds): only for the side that runs it
        compiled = copy.copy(loop)  # the same weights, optimizer and sampler, through torch.compile
        compiled.model = torch.compile(loop.model)
        sides["plain_compiled"] = Side("plain_compiled", compiled.run_step)
    return [sides[n] for n in wanted], base


def measure(sides: list[Side], args: argparse.Namespace, device: torch.device) -> None:
    """`--rounds` rounds, the order reversed every other round; each side's tokens/s per round."""
    tokens = args.steps * 2 * args.micro_batch * args.seq_len
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            side.losses.append(float(side.step()))  # untimed: compiles on the first round
            side.rates.append(tokens / timed(side.step, device, args.steps))


def gpu_busy(events: list[dict[str, Any]], start: float, end: float) -> float:
    """The share of [start, end] (µs) covered by the union of the GPU's kernel, copy and set intervals."""
    spans = sorted((max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in events
                   if e.get("cat") in GPU_KINDS and e["ts"] < end and e["ts"] + e["dur"] > start)
    busy, reach = 0.0, start
    for a, b in spans:
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return busy / (end - start)


def trace_of(side: Side, device: torch.device, steps: int) -> list[dict[str, Any]]:
    """The profiler's trace events of `steps` steps, inside one "bench_steps" annotation drained at its end."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        with record_function("bench_steps"):
            for _ in range(steps):
                side.step()
            sync()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def syncs_per_step(side: Side, device: torch.device) -> int:
    """Device-to-host synchronisations one step makes: on CUDA counted by torch's sync debug mode, on the CPU
    the reads of tensors into Python and explicit synchronisations (`record.host_syncs`: the same lines of
    code would stall a GPU)."""
    if device.type != "cuda":
        with HostSyncs().counting() as syncs:
            side.step()
        return syncs.by_step[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            side.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in seen)


class _ComputingOps(TorchDispatchMode):
    """Counts the aten ops a step dispatches that compute (views and aliases left out): on the CPU, the count
    of the kernels the same step would launch on a GPU."""

    FREE = frozenset({"view", "_unsafe_view", "detach", "t", "transpose", "permute", "expand", "slice", "select",
                      "split", "split_with_sizes", "unbind", "unsqueeze", "squeeze", "as_strided", "alias",
                      "lift_fresh", "reshape", "_reshape_alias"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.overloadpacket.__name__ not in self.FREE
        return func(*args, **(kwargs or {}))


def ops_per_step(side: Side) -> int:
    """One step's computing ops (`_ComputingOps`): the launches' stand-in on the CPU."""
    with _ComputingOps() as ops:
        side.step()
    return ops.count


def profile_side(side: Side, device: torch.device, steps: int) -> None:
    """Busy share, launches and host time per step from one profiled run (and syncs per step on CUDA)."""
    events = trace_of(side, device, steps)
    span = next(e for e in events if e.get("name") == "bench_steps" and e.get("cat") == "user_annotation")
    start, end = span["ts"], span["ts"] + span["dur"]
    cuda = device.type == "cuda"
    side.profile = {"step_ms": span["dur"] / 1e3 / steps,
                    "gpu_busy": gpu_busy(events, start, end) if cuda else None,
                    "launches_per_step": sum(e.get("name") in LAUNCHES for e in events) / steps if cuda
                    else ops_per_step(side),  # on the CPU: the ops that would launch a kernel
                    "syncs_per_step": syncs_per_step(side, device)}


def paired(a: Side, b: Side) -> list[float]:
    return [x / y for x, y in zip(a.rates, b.rates)]


def report(sides: list[Side], args: argparse.Namespace, flops_per_token: float, device: torch.device) -> list[str]:
    """The printed table: per side median tokens/s, MFU and profile figures; then the paired ratios."""
    peak = peak_flops(device)
    lines = [f"{'side':<16} {'tok/s':>11} {'MFU':>6} {'step ms':>8} {'GPU busy':>9} {'launch/step':>11} "
             f"{'syncs/step':>10} {'first loss':>10}"]
    for s in sides:
        tok, p = statistics.median(s.rates), s.profile
        m = mfu(tok, flops_per_token, 1, peak)
        lines.append(f"{s.name:<16} {tok:>11.1f} {'n/a' if m is None else f'{100 * m:.1f}%':>6} "
                     f"{p['step_ms']:>8.1f} {cell(p['gpu_busy'], '{:.1%}'):>9} "
                     f"{cell(p['launches_per_step'], '{:.0f}'):>11} {cell(p['syncs_per_step'], '{}'):>10} "
                     f"{s.losses[0]:>10.5f}")
    for other in sides[1:]:
        r = paired(sides[0], other)
        lines.append(f"{sides[0].name} / {other.name}: {statistics.median(r):.3f}× tokens/s (median of "
                     f"{len(r)} paired rounds: {', '.join(f'{x:.3f}' for x in r)}); host step time "
                     f"{sides[0].profile['step_ms'] / other.profile['step_ms']:.3f}×")
    return lines


def cell(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Build, measure, profile and print; returns every figure (and writes it to `--out`)."""
    device = torch.device(args.device)
    sides, base = build(args)
    flops = base.report.flops_per_token
    measure(sides, args, device)
    for s in sides:
        profile_side(s, device, args.profile_steps)
    out(f"{args.model}, seq {args.seq_len}, 2 × {args.micro_batch} sequences per step, hybrid at "
        f"train.precision={args.precision} {args.hybrid}, on {describe(device)}, torch {torch.__version__}")
    out("\n".join(report(sides, args, flops, device)))
    out(f"reproduce: {reproduce_command('hybrid.bench.vs_plain_loop', parser(), args)}")
    result = {"device": describe(device), "torch": torch.__version__, "args": {k: str(v) for k, v in
              vars(args).items()}, "sides": [{"name": s.name, "rates": s.rates, "losses": s.losses, **s.profile}
                                             for s in sides], "flops_per_token": flops}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def describe(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
