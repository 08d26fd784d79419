"""What 8 CPU ranks hold at gpt-350m / gpt-1b, measured against the estimate, and the largest model that fits.

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 15 python -m hybrid.bench.memory_at_scale \\
        --runs "gpt-350m tp2pp4 none" "gpt-350m pp2dp4 full zero" "gpt-1b tp2pp4 full layers=12" \\
        [--seq-len 256] [--micro-batch 1] [--global-batch N] [--steps 2] [--budget-gib 16] [--largest] [--json F]

A run is "MODEL LAYOUT RECOMPUTE [zero] [layers=N]": MODEL a configs/model name, LAYOUT `tpXppY` or
`ppYdpZ` (dp = 8 / (tp·pp)), RECOMPUTE none|selective|full, `zero` (or `zero1`) for ZeRO-1, `zero2`, `zero3`,
`layers=N` overriding the
model's layer count (same width). The global batch defaults to micro batch × dp × pp: pp microbatches per DP
rank, the fewest that fill 1F1B (its first stage then holds pp microbatches, as with more).

**Launch rule** (the machine is shared): a run is launched only when the estimate of all 8 ranks plus
`--overhead-gib` (0.4) per rank stays within `--budget-gib` (16) and within MemAvailable less 2 GiB; while
it runs a `MemoryWatch` kills the ranks if MemAvailable falls below 1 GiB.

**What is compared**, per rank: the estimate (`hybrid.memory.rank_memory` of the rank's own chunks, CPU
kernels: parameters, gradient buckets, AdamW moments, the activations 1F1B holds, a step's buffers — no
process, no allocator) against **measured** = the rank's peak resident set (VmHWM) during its last step less
its resident set (VmRSS) before it built anything (the forked process: Python, torch, the parent's pages).
Step 1 is run first and not compared: plain AdamW creates its moments at the end of step 1, after the
activations are gone, so only from step 2 on do moments and activations coexist (as in
tests/dist/test_memory.py, which compares the profiler's peak of the second step). VmHWM is reset before
the compared step (`/proc/self/clear_refs`); the peak of build + step 1 is reported beside it. The resident
set includes what glibc's malloc keeps of freed memory (`--mmap-threshold` sets M_MMAP_THRESHOLD and
M_TRIM_THRESHOLD in every rank to show how much that is).

`--largest`: by the estimate under the launch rule (and, beside it, for the whole machine: MemTotal less
2 GiB), the most layers at gpt-1b's width (2048) and at gpt-350m's (1024), at tp2pp4 and at pp2dp4, with no
memory features and with ZeRO-1 (where dp > 1) plus full recomputation. Launch the boundary with `--runs`
to check it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hybrid.bench.common import launch, table
from hybrid.bench.memory import MemoryWatch, proc_status_kb, rss_mib
from hybrid.config import Config, compose_config
from hybrid.memory import meta_stages, micro_of, rank_memory, stage_estimates
from hybrid.model import analytic_param_count
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout

WORLD = 8
GIB = 2**30
MIB = 2**20
OVERHEAD_GIB = 0.4  # the launch rule's allowance per rank for the process itself (measured: see the results)
BUDGET_GIB = 16.0  # the launch rule's ceiling for all 8 ranks on this shared 23.5 GiB machine
RESERVE_GIB = 2.0  # MemAvailable a launch must leave beside the rule (the watch kills the ranks at 1 GiB)
RECOMPUTE = ("none", "selective", "full")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@dataclass(frozen=True)
class Spec:
    """One run: model, layout (dp = WORLD / (tp·pp)), recomputation, ZeRO-1, layer count override."""

    model: str
    tp: int
    pp: int
    recompute: str
    zero: int = 0
    layers: Optional[int] = None

    @property
    def dp(self) -> int:
        return WORLD // (self.tp * self.pp)

    @property
    def layout(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}"

    def __str__(self) -> str:
        return " ".join([self.model, self.layout, self.recompute, *([f"zero{self.zero}"] if self.zero else []),
                         *([f"layers={self.layers}"] if self.layers else [])])


def parse_spec(text: str) -> Spec:
    """ "MODEL LAYOUT RECOMPUTE [zero] [layers=N]" → Spec; ValueError naming what is wrong."""
    words = text.split()
    if len(words) < 3:
        raise ValueError(f"run {text!r}: want 'MODEL LAYOUT RECOMPUTE [zero] [layers=N]'")
    model, layout, recompute, *rest = words
    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:dp(\d+))?", layout)
    if not m or not layout:
        raise ValueError(f"run {text!r}: layout {layout!r} is not tpXppY or ppYdpZ")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    if WORLD % (tp * pp) or (m.group(3) and int(m.group(3)) * tp * pp != WORLD):
        raise ValueError(f"run {text!r}: layout {layout!r} does not make {WORLD} ranks")
    if recompute not in RECOMPUTE:
        raise ValueError(f"run {text!r}: recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    zero, layers = 0, None
    for w in rest:
        if w == "zero" or re.fullmatch(r"zero[0-3]", w):
            zero = int(w[4:] or 1)
        elif w.startswith("layers=") and w[7:].isdigit():
            layers = int(w[7:])
        else:
            raise ValueError(f"run {text!r}: {w!r} is neither zero nor layers=N")
    return Spec(model, tp, pp, recompute, zero, layers)


def global_batch(spec: Spec, args: argparse.Namespace) -> int:
    """--global-batch, else micro batch × dp × pp (pp microbatches per DP rank)."""
    return args.global_batch or args.micro_batch * spec.dp * spec.pp


def overrides(spec: str | Spec, args: argparse.Namespace, layers: Optional[int] = None) -> list[str]:
    """The config overrides of a run (fp32, CPU, no eval)."""
    s = parse_spec(spec) if isinstance(spec, str) else spec
    layers = layers or s.layers
    return [f"model={s.model}", f"parallel.tp={s.tp}", f"parallel.pp={s.pp}", f"parallel.dp={s.dp}",
            f"parallel.zero={s.zero}", f"train.recompute={s.recompute}", f"data.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={global_batch(s, args)}",
            "train.eval_every=0", "train.precision=fp32", "train.device=cpu", "parallel.name=bench",
            *([f"model.n_layers={layers}"] if layers else [])]


def machine_estimate(cfg: Config) -> tuple[int, list[int]]:
    """Bytes of all 8 ranks by the estimate (each stage's first TP rank stands for its TP and DP peers), and
    each stage's estimate."""
    from hybrid.trainer import build_chunks

    p = cfg.parallel
    layout = Layout.create(WORLD, tp=p.tp, pp=p.pp)
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    stages = [e.total for e in stage_estimates(cfg, layout, meta_stages(layout, lambda c: build_chunks(
        cfg, vocab, c)), "cpu")]
    return sum(stages) * p.tp * layout.dp, stages


def need_bytes(total: int, overhead_gib: float) -> int:
    """What the launch rule charges a run: the 8 ranks' estimate plus the per-rank process allowance."""
    return total + int(WORLD * overhead_gib * GIB)


def refusal(need: int, budget_gib: float, available: int) -> Optional[str]:
    """Why the launch rule refuses a run charged `need` bytes, or None when it may be launched."""
    if need > budget_gib * GIB:
        return f"estimate + {WORLD} × process = {need / GIB:.1f} GiB > the {budget_gib:g} GiB rule"
    if need > available - RESERVE_GIB * GIB:
        return f"estimate + {WORLD} × process = {need / GIB:.1f} GiB > MemAvailable {available / GIB:.1f} − 2 GiB"
    return None


def meminfo_bytes(key: str) -> int:
    return proc_status_kb(Path("/proc/meminfo").read_text(), key) * 1024


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux ≥ 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def pss_mib() -> float:
    """This process's proportional set size (shared pages divided among their sharers), MiB; 0 if unknown."""
    try:
        return proc_status_kb(Path("/proc/self/smaps_rollup").read_text(), "Pss") / 1024
    except OSError:
        return 0.0


def rank_run(rank: int, world: int, cfg_overrides: list[str], steps: int, mmap_threshold: int) -> dict[str, Any]:
    """One rank: its resident set before building, the peak of build + step 1, the peak of the last step (VmHWM
    reset after step 1), the resident set after; its estimate. Figures in MiB, over the baseline."""
    from hybrid.bench.inputs import bench_trainer

    if mmap_threshold:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, mmap_threshold)
    reset_peak()
    base, base_pss = rss_mib(), pss_mib()
    trainer = bench_trainer(world, cfg_overrides, None)
    built = rss_mib() - base
    times = []
    for step in range(steps):
        if step == 1:
            first = rss_mib("VmHWM") - base
            resets = reset_peak()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    peak = rss_mib("VmHWM") - base
    if steps == 1:
        first, resets = peak, False
    shard = C.size(trainer.grad_sync.group)  # the DP ranks ZeRO shards over
    est = rank_memory(trainer.cfg, trainer.model, trainer.schedule, trainer.ctx.pp_rank, shard, micro_of(trainer.cfg))
    c = trainer.ctx.coord
    return {"rank": rank, "coord": (c.pp, c.dp, c.tp), "base": base, "base_pss": base_pss, "built": built,
            "first": first, "measured": peak if resets else max(peak, first), "resets": resets,
            "after": rss_mib() - base, "step_s": times,
            "estimate": est.total / MIB, "parts": {k: getattr(est, k) / MIB for k in
                                                    ("params", "grads", "optimizer", "activations", "buffers")}}


def measure(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch `spec` when the launch rule allows it; else say why not."""
    s = parse_spec(spec)
    cfg = compose_config(overrides(s, args))
    total, stages = machine_estimate(cfg)
    available = meminfo_bytes("MemAvailable")
    need = need_bytes(total, args.overhead_gib)
    out: dict[str, Any] = {"spec": str(s), "n_layers": cfg.model.n_layers, "global_batch": global_batch(s, args),
                           "estimate_total": total / GIB, "need": need / GIB, "available_before": available / GIB}
    why = refusal(need, args.budget_gib, available)
    if why:
        return {**out, "skipped": "not launched: " + why}
    load, t0 = os.getloadavg()[0], time.monotonic()
    try:
        with MemoryWatch() as watch:
            ranks = launch(rank_run, WORLD, overrides(s, args), args.steps, args.mmap_threshold, timeout=3600)
    except (MemoryError, RuntimeError, TimeoutError) as e:  # the watch killed the ranks, or a rank failed
        return {**out, "skipped": f"failed after {time.monotonic() - t0:.0f} s: {str(e).splitlines()[-1]}"}
    worst = max(ranks, key=lambda r: r["measured"])
    return {**out, "ranks": ranks, "watch": watch.line(), "least_available": watch.peaks.get("min_available", 0)
            / 2**20, "load_before": load, "load_after": os.getloadavg()[0], "wall_s": time.monotonic() - t0,
            "max_measured": worst["measured"], "its_estimate": worst["estimate"],
            "max_estimate": max(r["estimate"] for r in ranks)}


def most_layers(fits: Callable[[int], bool], start: int, stop: int) -> Optional[int]:
    """The largest n in [start, stop] with fits(n), by bisection (the estimate grows with the layer count, so
    `fits` holds up to some n and not beyond); None when `start` does not fit."""
    if not fits(start):
        return None
    lo, hi = start, stop + 1  # fits(lo); hi is past the last candidate
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


LARGEST = [("gpt-1b", "tp2pp4", "none"), ("gpt-1b", "tp2pp4", "full"), ("gpt-1b", "pp2dp4", "none"),
           ("gpt-1b", "pp2dp4", "full zero"), ("gpt-350m", "tp2pp4", "none"), ("gpt-350m", "tp2pp4", "full"),
           ("gpt-350m", "pp2dp4", "none"), ("gpt-350m", "pp2dp4", "full zero"), ("gpt-1b", "pp2dp4", "full zero3"),
           ("gpt-350m", "pp2dp4", "full zero3")]
"""(width, layout, features) searched by `--largest` (ZeRO only where dp > 1: at tp2pp4 dp is 1)."""


def largest(args: argparse.Namespace, machine_gib: float, stop: int = 96) -> list[list[Any]]:
    """Per (width, layout, features): the most layers whose 8 ranks the launch rule admits (estimate + overhead
    ≤ --budget-gib), and the most the whole machine would (≤ `machine_gib`), with their parameters."""
    rows = []
    for width, layout, features in LARGEST:
        base = parse_spec(f"{width} {layout} {features}")
        cache: dict[int, float] = {}

        def need_gib(n: int, base: Spec = base, cache: dict[int, float] = cache) -> float:
            if n not in cache:
                cfg = compose_config(overrides(base, args, layers=n))
                cache[n] = need_bytes(machine_estimate(cfg)[0], args.overhead_gib) / GIB
            return cache[n]

        row = [width + "'s width", base.layout, features]
        for budget in (args.budget_gib, machine_gib):
            n = most_layers(lambda k, b=budget: need_gib(k) <= b, base.pp, stop)
            if n is None:
                row += ["none", "-", f"{need_gib(base.pp):.1f} at {base.pp}"]
                continue
            cfg = compose_config(overrides(base, args, layers=n))
            row += [n, f"{analytic_param_count(cfg.model, cfg.model.vocab_size) / 1e9:.3f} B", f"{need_gib(n):.1f}"]
        rows.append(row)
    return rows


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.memory_at_scale", description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="*", default=["gpt-350m tp2pp4 none", "gpt-350m tp2pp4 full"],
                   help="'MODEL LAYOUT RECOMPUTE [zero] [layers=N]' each")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None, help="default: micro batch × dp × pp")
    p.add_argument("--steps", type=int, default=2, help="training steps; the last one's peak is compared")
    p.add_argument("--budget-gib", type=float, default=BUDGET_GIB, help="the launch rule's ceiling, all ranks")
    p.add_argument("--overhead-gib", type=float, default=OVERHEAD_GIB, help="the launch rule's process per rank")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="bytes: glibc M_MMAP_THRESHOLD and M_TRIM_THRESHOLD in every rank (0: glibc's defaults)")
    p.add_argument("--largest", action="store_true", help="the largest model per layout and features (estimates)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    for spec in args.runs:
        try:
            parse_spec(spec)
        except ValueError as e:
            p.error(str(e))
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def gib(mib: float) -> str:
    return f"{mib / 1024:.2f}"


def report(results: list[dict[str, Any]]) -> list[str]:
    """The summary table (one row per run) and each launched run's per-rank table."""
    rows, detail = [], []
    for r in results:
        if "skipped" in r:
            rows.append([r["spec"], r["global_batch"], r["skipped"], "", "", "", "", ""])
            continue
        ranks = r["ranks"]
        worst = max(ranks, key=lambda x: x["measured"])
        rows.append([r["spec"], r["global_batch"], gib(worst["measured"]), gib(worst["estimate"]),
                     f"{worst['estimate'] / worst['measured']:.2f}", " ".join(gib(x["measured"]) for x in ranks),
                     " ".join(f"{x['estimate'] / x['measured']:.2f}" for x in ranks),
                     f"{sum(x['measured'] for x in ranks) / 1024:.1f} / {r['estimate_total']:.1f}"])
        detail += [f"{r['spec']}: {r['watch']}; MemAvailable before {r['available_before']:.1f} GiB; load "
                   f"{r['load_before']:.1f} → {r['load_after']:.1f}; {r['wall_s']:.0f} s; step s (rank 0) "
                   + " ".join(f"{t:.0f}" for t in ranks[0]["step_s"])]
        detail += table(["rank", "(pp,dp,tp)", "base RSS/PSS MiB", "built", "peak build+step 1", "peak last step",
                         "after", "estimate", "params", "grads", "optimizer", "activations", "buffers", "est/meas"],
                        [[x["rank"], "({},{},{})".format(*x["coord"]), f"{x['base']:.0f}/{x['base_pss']:.0f}",
                          f"{x['built']:.0f}", f"{x['first']:.0f}", f"{x['measured']:.0f}", f"{x['after']:.0f}",
                          f"{x['estimate']:.0f}", *(f"{v:.0f}" for v in x["parts"].values()),
                          f"{x['estimate'] / x['measured']:.3f}"] for x in ranks]) + [""]
    head = table(["run", "global batch", "max measured GiB", "its estimate GiB", "est/meas",
                  "measured per rank 0..7 GiB", "est/meas per rank 0..7", "Σ measured / Σ estimate GiB"], rows)
    return head + [""] + detail


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    malloc = f"M_MMAP_THRESHOLD={args.mmap_threshold}" if args.mmap_threshold else "glibc defaults"
    print(f"{WORLD} forked gloo ranks, fp32, micro batch {args.micro_batch} × {args.seq_len} tokens, global batch "
          f"{args.global_batch or 'micro × dp × pp'}, 1F1B, {args.steps} step(s) (the last compared); malloc "
          f"{malloc}; launch "
          f"rule: estimate + {WORLD} × {args.overhead_gib} GiB ≤ {args.budget_gib:g} GiB; load average "
          f"{os.getloadavg()[0]:.2f}; MemAvailable {meminfo_bytes('MemAvailable') / GIB:.1f} GiB")
    results = []
    for spec in args.runs:
        results.append(measure(spec, args))
        r = results[-1]
        print(f"done: {spec} ({r['skipped'] if 'skipped' in r else str(round(r['wall_s'])) + ' s'})", flush=True)
        out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}
        if args.json:  # after every run: a later failure keeps what was measured
            args.json.write_text(json.dumps(out, indent=1, default=str))
    print("\n".join(report(results)))
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}
    if args.largest:
        bases = [x["base_pss"] for r in results for x in r.get("ranks", [])]
        machine = meminfo_bytes("MemTotal") / GIB - RESERVE_GIB
        print(f"largest model on {WORLD} ranks by the estimate (+ {args.overhead_gib} GiB per rank; measured "
              f"per-rank baseline PSS {statistics.median(bases) / 1024 if bases else float('nan'):.2f} GiB), "
              f"under the {args.budget_gib:g} GiB rule and under the whole machine (MemTotal − 2 = {machine:.1f} GiB):")
        rows = largest(args, machine)
        out["largest"] = rows
        print("\n".join(table(["width", "layout", "features", f"layers ≤{args.budget_gib:g}", "params",
                               "GiB charged", f"layers ≤{machine:.1f}", "params", "GiB charged"], rows)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
