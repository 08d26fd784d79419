"""The GPU check: does hybrid run on this machine's GPU, and how fast — in one command, under 10 minutes.

    hybrid-gpucheck [--models gpt-125m gpt-1b] [--seq-len 1024] [--micro-batch 8] [--steps 10] [--out FILE]
                    [--settings bf16_params bf16_params+compile] [--no-reference]
    hybrid-gpucheck --dry-run        # the same code paths on CPU with a tiny model (CI runs it)

On one CUDA GPU it runs, in order:

1. the unit tests (`pytest tests/unit`, a subprocess; they use the CPU, and check the install here) and the
   CUDA path against the CPU: two fp32 steps of a small GPT on each, from the same weights and data;
2. per model (gpt or llama family) and per setting — `train.precision` bf16 (autocast) and bf16_params, each
   with and without `train.compile`, or the `--settings` named — a single-rank training run, its steps as
   `Trainer.fit` runs them (figures read from the device only every `logging.log_every` steps): tokens/s after
   warm-up, **MFU** (model FLOPs per token × tokens/s over the GPU's dense bf16 peak, `metrics.peak_flops`),
   the peak of allocated memory against `hybrid.memory`'s estimate, and the attention kernel SDPA really ran
   (from the profiler's ops);
3. per gpt-family model (unless `--no-reference`), hybrid (bf16_params) side by side with a plain PyTorch loop
   on transformers' GPT2LMHeadModel under bf16 autocast with SDPA and fused AdamW (`bench.step_vs_hf`),
   alternating rounds.

It prints a table and writes every figure to a JSON file (`--out`, default runs/gpucheck/<time>.json).
Without a GPU it exits with one line unless `--dry-run`, which runs steps 1–3 on CPU with gpt-tiny, a few
tokens and no compile (compile on CPU is `tests/unit/test_compile.py`'s), the tests replaced by the CPU
against itself. Exit status: 0 when everything ran, 1 when a test or a measurement failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hybrid.bench.gpucheck_steps import Setting, cuda_matches_cpu, measure, side_by_side
from hybrid.cli import EXIT_BAD_INPUT, UsageError
from hybrid.config import ConfigError, compose_config
from hybrid.overrides import one_line

ROOT = Path(__file__).resolve().parents[2]
TESTS_TIMEOUT_S = 300  # the unit tests' share of the check's 10 minutes


@dataclass(frozen=True)
class Plan:
    """What one check runs: on which device, which models at which shapes, how many steps."""

    device: torch.device
    models: tuple[str, ...]
    seq_len: int
    micro_batch: int
    warmup: int
    steps: int
    settings: tuple[Setting, ...]
    rounds: int
    dry_run: bool
    references: tuple[str, ...] = ()  # the models run beside transformers' loop


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybrid-gpucheck", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on CPU, tiny: the code paths only (CI)")
    p.add_argument("--models", nargs="+", default=None, help="gpt or llama configs (default gpt-125m gpt-1b)")
    p.add_argument("--settings", nargs="+", default=None, metavar="PRECISION[+compile]",
                   help="on a GPU (default bf16 bf16+compile bf16_params bf16_params+compile)")
    p.add_argument("--no-reference", action="store_true", help="skip the transformers loop beside hybrid")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8, help="at most this; less when the estimate says so")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 untimed)")
    p.add_argument("--no-tests", action="store_true", help="skip the unit tests")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def plan_for(args: argparse.Namespace) -> Plan:
    """The dry run's tiny CPU plan (4 tokens a sequence: bf16 on a CPU is slow), or the GPU's; no GPU without
    --dry-run is bad input."""
    if args.dry_run:
        models, settings = tuple(args.models or ("gpt-tiny",)), settings_of(args, (Setting("bf16_params", False),))
        return Plan(torch.device("cpu"), models, 4, 1, 1, 1, settings, 2, True, references(models, args.no_reference))
    if not torch.cuda.is_available():
        raise UsageError("no CUDA device here: hybrid-gpucheck measures a GPU (use --dry-run to run its code "
                         "paths on CPU)")
    models = tuple(args.models or ("gpt-125m", "gpt-1b"))
    return Plan(torch.device("cuda"), models, args.seq_len, args.micro_batch, 3, args.steps, settings_of(args), 4,
                False, references(models, args.no_reference))


def references(models: tuple[str, ...], skip: bool) -> tuple[str, ...]:
    """The models run beside transformers' GPT-2 loop: the gpt-family ones, none with `--no-reference`; an
    unknown model config is bad input here, before anything runs."""
    from hydra.errors import HydraException

    try:
        families = [compose_config([f"model={m}"]).model.family for m in models]
    except (ConfigError, HydraException) as e:  # Hydra's "Could not find 'model/…'" and its options
        raise UsageError(f"--models: {one_line(e)}") from None
    return () if skip else tuple(m for m, f in zip(models, families) if f == "gpt")


def settings_of(args: argparse.Namespace, default: tuple[Setting, ...] = ()) -> tuple[Setting, ...]:
    """`--settings` parsed, or `default`, or all four: bf16 and bf16_params, each with and without compile."""
    if args.settings:
        return tuple(Setting.parse(s) for s in args.settings)
    return default or tuple(Setting(p, c) for p in ("bf16", "bf16_params") for c in (False, True))


def unit_tests(plan: Plan, skip: bool) -> dict[str, Any]:
    """`pytest tests/unit` in a subprocess: its exit status and last line (skipped in a dry run: CI runs them)."""
    if skip or plan.dry_run or not (ROOT / "tests" / "unit").is_dir():
        return {"ran": False, "why": "dry run or --no-tests or no tests folder"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/unit"]
    if importlib.util.find_spec("xdist") is not None:  # a GPU machine has cores: 4 workers, whole files each
        cmd += ["-n", "4", "--dist", "loadfile"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ran": True, "ok": False, "summary": f"timed out after {TESTS_TIMEOUT_S} s"}
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"ran": True, "ok": done.returncode == 0, "summary": last}


def run(plan: Plan, tests: bool = True) -> dict[str, Any]:
    """Every part of the check, each failure caught and recorded as its one line."""
    out: dict[str, Any] = {"device": describe(plan.device), "torch": torch.__version__, "dry_run": plan.dry_run,
                           "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out["tests"] = unit_tests(plan, not tests)
    out["cuda_vs_cpu"] = guarded(lambda: cuda_matches_cpu(plan.device))
    out["runs"] = [guarded(lambda m=m, s=s: measure(plan, m, s)) | {"model": m, "setting": str(s)}
                   for m in plan.models for s in plan.settings]
    out["vs_reference"] = [guarded(lambda m=m: side_by_side(plan, m)) | {"model": m} for m in plan.references]
    return out


def guarded(part: Any) -> dict[str, Any]:
    """`part()`'s figures, or {"error": one line} when it fails (an out-of-memory, a kernel missing)."""
    try:
        return part()
    except Exception as e:  # noqa: BLE001 - a check reports every failure and goes on
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"
    return "cpu"


def failed(result: dict[str, Any]) -> bool:
    parts = [result["cuda_vs_cpu"], *result["runs"], *result["vs_reference"]]
    tests = result["tests"]
    return any("error" in p for p in parts) or (tests["ran"] and not tests["ok"]) or not result["cuda_vs_cpu"]["ok"]


def report(result: dict[str, Any]) -> list[str]:
    """The printed table."""
    t, c = result["tests"], result["cuda_vs_cpu"]
    lines = [f"gpu check: {result['device']}, torch {result['torch']}{' (dry run)' if result['dry_run'] else ''}",
             f"unit tests: {t.get('summary', t.get('why'))}",
             f"cuda vs cpu: {c.get('error') or ('ok' if c['ok'] else 'MISMATCH') + ' ' + str(c.get('losses'))}",
             f"{'model':<10} {'setting':<22} {'tok/s':>10} {'MFU':>6} {'peak mem':>10} {'estimate':>10} "
             f"{'sdpa':>14}"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['model']:<10} {r['setting']:<22} error: {r['error']}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}G"
        lines.append(f"{r['model']:<10} {r['setting']:<22} {r['tokens_per_s']:>10.1f} {mfu:>6} {peak:>10} "
                     f"{r['estimate_bytes'] / 2**30:>9.2f}G {r['sdpa']:>14}")
    for r in result["vs_reference"]:
        body = r.get("error") or (f"hybrid {r['hybrid_tokens_per_s']:.1f} tok/s, reference "
                                  f"{r['reference_tokens_per_s']:.1f} tok/s: {r['ratio']:.3f}× (median paired)")
        lines.append(f"vs transformers loop, {r['model']}: {body}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        plan = plan_for(args)
    except UsageError as e:
        print(f"hybrid: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = run(plan, tests=not args.no_tests)
    print("\n".join(report(result)))
    path = args.out or Path("runs/gpucheck") / time.strftime("%Y%m%d-%H%M%S.json", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"figures: {path}")
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
