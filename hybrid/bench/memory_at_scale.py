"""What 8 CPU ranks hold at gpt-350m / gpt-1b, measured against the estimate, and the largest model that fits.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.memory_at_scale --runs "gpt-350m tp2pp4 none" \\
        "gpt-350m pp2dp4 full zero" [--seq-len 256] [--micro-batch 1] [--global-batch 8] [--largest]

A run is "MODEL LAYOUT RECOMPUTE [zero] [layers=N]" (layout tpXppY, dp = 8 / (tp·pp); N overrides the
model's layer count). Each is launched on 8 forked
gloo ranks only when the estimate of the whole machine (every rank's estimate plus 0.4 GiB of process per
rank) leaves 3 GiB of MemAvailable; a watch kills the ranks if MemAvailable falls below 1 GiB. Each rank
reads its resident set before building anything (the forked process: Python, torch, the parent's pages)
and its peak (VmHWM) after one training step; **measured** = peak − that baseline, against the rank's
estimate (`hybrid.memory.rank_memory`, this rank's real chunks, CPU kernels).

`--largest`: at gpt-350m's and gpt-1b's widths, the most layers (multiples of 8) whose 8 ranks the
estimate fits in MemAvailable less 2 GiB (with the measured per-rank baseline), at tp2pp4 and
at pp2dp4, with and without ZeRO-1 and full recomputation; estimates only (launch one with --runs to check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from hybrid.bench.common import table
from hybrid.bench.inputs import bench_trainer
from hybrid.bench.memory import MemoryWatch, proc_status_kb, rss_mib
from hybrid.config import Config, compose_config
from hybrid.memory import meta_stages, micro_of, rank_memory, stage_estimates
from hybrid.model import analytic_param_count
from hybrid.parallel.context import Layout
from hybrid.testing.ranks import launch

WORLD = 8
PROCESS_GIB = 0.3  # a rank's own resident set before its model: Python, torch, gloo (measured 0.24)
GIB = 2**30


def overrides(spec: str, args: argparse.Namespace, layers: Optional[int] = None) -> list[str]:
    """The config overrides of a run spec "MODEL tpXppY RECOMPUTE [zero] [layers=N]"."""
    model, layout, recompute, *rest = spec.split()
    layers = layers or next((int(w.split("=")[1]) for w in rest if w.startswith("layers=")), None)
    tp, pp = (int(x) for x in layout.removeprefix("tp").split("pp"))
    return [f"model={model}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={WORLD // (tp * pp)}",
            f"parallel.zero={int('zero' in rest)}", f"train.recompute={recompute}", f"data.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
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


def rank_run(rank: int, world: int, cfg_overrides: list[str]) -> dict[str, Any]:
    """One rank: baseline RSS, build, one step, peak RSS; this rank's estimate."""
    base = rss_mib() * 2**20
    trainer = bench_trainer(world, cfg_overrides, None)
    trainer.train_step()
    peak = rss_mib("VmHWM") * 2**20
    est = rank_memory(trainer.cfg, trainer.model, trainer.schedule, trainer.ctx.pp_rank, trainer.ctx.dp_size,
                      micro_of(trainer.cfg))
    c = trainer.ctx.coord
    return {"coord": (c.pp, c.dp, c.tp), "base": base, "measured": peak - base, "estimate": est.total}


def measure(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch `spec` when the estimate leaves room; else say why not."""
    cfg = compose_config(overrides(spec, args))
    total, _ = machine_estimate(cfg)
    available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable") * 1024
    need = total + WORLD * PROCESS_GIB * GIB
    if need > available - 2 * GIB:
        return {"spec": spec, "skipped": f"estimate {need / GIB:.1f} GiB > MemAvailable {available / GIB:.1f} GiB − 2"}
    with MemoryWatch() as watch:
        ranks = launch(rank_run, WORLD, overrides(spec, args), timeout=3600)
    ratios = [r["estimate"] / r["measured"] for r in ranks]
    return {"spec": spec, "ranks": ranks, "ratios": ratios, "machine": watch.line(),
            "max_measured": max(r["measured"] for r in ranks), "max_estimate": max(r["estimate"] for r in ranks)}


def largest(args: argparse.Namespace, base_gib: float) -> list[list[Any]]:
    """Per layout, feature set and width (gpt-350m's, gpt-1b's): the most layers (a multiple of 8, so that
    every stage split stays even) whose 8 ranks the estimate fits in MemAvailable − 2 GiB (what `measure`
    would launch)."""
    available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable") * 1024
    budget = available - 2 * GIB - WORLD * base_gib * GIB  # the launch guard's own rule (`measure`)
    rows = []
    for layout in ("tp2pp4", "tp1pp2"):
        for features in ("none", "full zero"):
            for width in ("gpt-350m", "gpt-1b"):
                best = None
                for layers in range(8, 129, 8):
                    cfg = compose_config(overrides(f"{width} {layout} {features}", args, layers))
                    if machine_estimate(cfg)[0] > budget:
                        break
                    best = (layers, analytic_param_count(cfg.model, cfg.model.vocab_size))
                rows.append([layout + ("" if layout == "tp2pp4" else "dp4"), features, f"{width}'s",
                             best[0] if best else "none", f"{best[1] / 1e9:.2f}B" if best else "-"])
    return rows


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.memory_at_scale", description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="*", default=["gpt-350m tp2pp4 none", "gpt-350m tp2pp4 full"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--largest", action="store_true", help="the largest gpt-1b-wide model per layout (estimates)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    print(f"8 ranks, micro batch {args.micro_batch} × {args.seq_len} tokens, global batch {args.global_batch}, fp32; "
          f"load average {os.getloadavg()[0]:.2f}")
    rows, bases = [], []
    for spec in args.runs:
        r = measure(spec, args)
        if "skipped" in r:
            rows.append([spec, "skipped: " + r["skipped"], "", "", "", ""])
            continue
        bases += [x["base"] for x in r["ranks"]]
        gap = max(x["measured"] - x["estimate"] for x in r["ranks"]) / GIB
        rows.append([spec, f"{r['max_measured'] / GIB:.2f}", f"{r['max_estimate'] / GIB:.2f}", f"{gap:.2f}",
                     " ".join(f"{x:.2f}" for x in r["ratios"]), r["machine"]])
    print("\n".join(table(["run", "max measured GiB", "max estimate GiB", "most measured − estimate GiB",
                           "estimate/measured per rank", "machine"], rows)))
    if args.largest:
        base = statistics.median(bases) / GIB if bases else PROCESS_GIB
        print(f"largest model on 8 ranks by the estimate (per-rank process {base:.2f} GiB):")
        print("\n".join(table(["layout", "features", "width", "layers", "parameters"], largest(args, base))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
