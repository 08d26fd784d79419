"""The longest sequence a model trains on this machine's ranks, with context parallelism and without.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.cp_longest [--model gpt-125m] [--world 8] [--cp 1 8]

For each --cp size, --world gloo ranks (one torch thread each) train --model at `parallel.cp=cp` and
dp = world / cp, one sequence per DP replica, with `parallel.zero=1` and --overrides: one full `Trainer` step
(forward, backward, gradient sync, optimizer) per launch. Memory is the machine's, shared by every rank: a
length fits when the ranks' peak resident memories (`ru_maxrss`) sum to no more than --budget-gib (default:
what /proc/meminfo calls available at the start, less a 1.5 GiB margin). The sum is slightly conservative
(pages a forked rank still shares with its parent count once per rank); the machine's used memory sampled
from a thread misses the head's short-lived logits peaks and let the kernel kill a rank, so it is not used.

The search measures rather than guesses: it doubles the length from --start while launches fit; before each
launch past the second it draws the line through the last two (what does not grow with the tokens — processes,
weights, gradients, optimizer state — and what does: activations, linear in the tokens as flash attention keeps
no score matrix; learned positions add a little more) and stops doubling when the line says the doubling will
not fit. Then it closes in, up to --refine launches: the longest multiple of --grain the line through the
longest fitting launch and the shortest measured one above it predicts to fit. Reported: every launch (length,
the ranks' summed peak against the budget, the step time), and per cp size the longest length that trained
within the budget with the next grain's prediction beyond it. A length is never launched past the prediction:
on a machine without swap that would be the kernel's OOM killer, not a measurement.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

MODULE = "hybrid.bench.cp_longest"
GIB = 2**30
VOCAB = 50304  # GPT-2's vocabulary, padded: the head is a real model's
MARGIN_GIB = 1.5
QUICK = {"model": "gpt-tiny", "world": 2, "cp": [1, 2], "start": 256, "grain": 256, "max": 2048, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny on 2 ranks up to 1,024 tokens, seconds")
    p.add_argument("--model", default="gpt-125m", help="a configs/model name")
    p.add_argument("--world", type=int, default=8, help="ranks")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 8], help="CP sizes (1: no CP, dp = world)")
    p.add_argument("--start", type=int, default=1024, help="tokens of the first, measuring launch")
    p.add_argument("--grain", type=int, default=1024, help="lengths tried are multiples of this")
    p.add_argument("--max", type=int, default=131072, help="the longest length considered")
    p.add_argument("--budget-gib", type=float, default=None, help="memory the ranks may hold together")
    p.add_argument("--overrides", nargs="*", default=["train.recompute=none"], help="hybrid.train overrides")
    p.add_argument("--refine", type=int, default=3, help="launches closing in once doubling stops")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a launch is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = common.parse_with_quick(p, argv, QUICK)
    common.check_models(p, args.model)
    if any(c < 1 or args.world % c for c in args.cp) or min(args.start, args.grain, args.max) < 1:
        p.error("every --cp must divide --world; --start, --grain and --max must be >= 1")
    if any(args.grain % (2 * c) or args.start % (2 * c) for c in args.cp):
        p.error("--start and --grain must be divisible by 2·cp for every --cp")
    return args


def meminfo_bytes(key: str) -> int:
    """One /proc/meminfo field, in bytes."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[key].split()[0]) * 1024


def config(args: argparse.Namespace, cp: int, seq: int) -> Any:
    cfg = compose_config([f"model={args.model}", "model.dropout=0", f"model.max_seq_len={seq}",
                          f"data.seq_len={seq}", "train.micro_batch_size=1",
                          f"train.global_batch_size={args.world // cp}", "train.steps=1", "train.eval_every=0",
                          f"parallel.cp={cp}", "parallel.zero=1", *args.overrides])
    validate(cfg, args.world)
    return cfg


def step_rank(rank: int, world: int, cfg: Any) -> dict[str, float]:
    """One training step of this rank: the process's peak resident memory, the step's seconds."""
    layout = Layout.create(world, cp=cfg.parallel.cp) if world > 1 else Layout(world=1)
    ctx = ParallelContext.build(layout)
    seq = cfg.data.seq_len
    samples = np.random.default_rng(0).integers(0, VOCAB, size=(world, seq + 1)).astype(np.int32)
    data = Corpus(tokenizer=None, vocab_size=VOCAB, eos_id=0, train=samples, eval=samples[:1], seq_len=seq)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), data, torch.device("cpu"))
    start = time.perf_counter()
    trainer.train_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak": peak, "step_s": time.perf_counter() - start}


def predicted(a: dict[str, Any], b: dict[str, Any], length: int) -> float:
    """The ranks' summed peak at `length` tokens on the line through launches `a` and `b`."""
    return a["rss"] + (b["rss"] - a["rss"]) * (length - a["seq"]) / (b["seq"] - a["seq"])


def search(args: argparse.Namespace, cp: int, budget: float, out: Callable[[str], None]) -> dict[str, Any]:
    """Double the length while it fits (past two launches, only where the line through the last two predicts a
    fit); then close in, up to --refine launches (`_closer`)."""
    runs = [_launch(args, cp, args.start, budget, out)]
    while runs[-1]["fits"] and runs[-1]["seq"] < args.max:
        length = min(2 * runs[-1]["seq"], args.max)
        if len(runs) >= 2 and predicted(runs[-2], runs[-1], length) > budget:
            break
        runs.append(_launch(args, cp, length, budget, out))
    for _ in range(args.refine):
        length = _closer(args, runs, budget)
        if length is None:
            break
        runs.append(_launch(args, cp, length, budget, out))
    done = sorted((r for r in runs if r["fits"]), key=lambda r: r["seq"])
    if len(done) < 2:
        return {"cp": cp, "runs": runs, "longest": done[0]["seq"] if done else 0, "next": 0, "next_predicted": 0.0}
    beyond = done[-1]["seq"] + args.grain  # measured if launched, else on the line through the two longest that fit
    seen = [r["rss"] for r in runs if r["seq"] == beyond]
    return {"cp": cp, "runs": runs, "longest": done[-1]["seq"], "next": beyond, "next_measured": bool(seen),
            "next_predicted": seen[0] if seen else predicted(done[-2], done[-1], beyond)}


def _closer(args: argparse.Namespace, runs: list[dict[str, Any]], budget: float) -> Optional[int]:
    """The longest grain below what is known not to fit (a launch, or the doubling) that the line through the
    longest fitting launch and the shortest measured one above it (else the two longest fitting) predicts to
    fit; None when there is none."""
    done = sorted((r for r in runs if r["fits"]), key=lambda r: r["seq"])
    if not done:
        return None
    lo = done[-1]
    above = sorted((r for r in runs if not r["fits"] and r["seq"] > lo["seq"]), key=lambda r: r["seq"])
    measured = [r for r in above if r["rss"] != float("inf")]
    line = (lo, measured[0]) if measured else (done[-2], lo) if len(done) >= 2 else None
    top = above[0]["seq"] if above else min(2 * lo["seq"], args.max + args.grain)
    fitting = [n for n in range(lo["seq"] + args.grain, top, args.grain) if line and predicted(*line, n) <= budget]
    return fitting[-1] if fitting else None


def _launch(args: argparse.Namespace, cp: int, seq: int, budget: float, out: Callable[[str], None]) -> dict[str, Any]:
    try:
        ranks = launch(step_rank, args.world, config(args, cp, seq), timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 — a rank killed (out of memory) or timed out: this length did not train
        out(f"  cp={cp} seq={seq}: failed: {str(e).splitlines()[0][:200]}")
        return {"cp": cp, "seq": seq, "rss": float("inf"), "fits": False, "step_s": float("nan")}
    rss = sum(r["peak"] for r in ranks)
    row = {"cp": cp, "seq": seq, "rss": rss, "fits": rss <= budget, "step_s": max(r["step_s"] for r in ranks)}
    out(f"  cp={cp} seq={seq}: ranks' summed peak {rss / GIB:.2f} GiB of {budget / GIB:.2f}, "
        f"step {row['step_s']:.1f} s")
    return row


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    free = meminfo_bytes("MemAvailable") / GIB - MARGIN_GIB
    budget = (args.budget_gib if args.budget_gib is not None else free) * GIB
    out(f"\n## {args.model} on {args.world} ranks, one sequence per DP replica, ZeRO-1, {' '.join(args.overrides)}; "
        f"budget {budget / GIB:.2f} GiB for the ranks' summed peak resident memory")
    results = [search(args, cp, budget, out) for cp in args.cp]
    out("\n".join(common.table(["layout", "longest tokens", "its peak GiB", "next", "next's peak GiB"],
                               [_row(args, r) for r in results])))
    return results


def _row(args: argparse.Namespace, r: dict[str, Any]) -> list[str]:
    grown = next((x["rss"] for x in r["runs"] if x["seq"] == r["longest"] and x["fits"]), None)
    return [f"cp{r['cp']} dp{args.world // r['cp']}", f"{r['longest']:,}",
            f"{grown / GIB:.2f}" if grown is not None else "—",
            f"{r['next']:,}" if r["next"] else "—",
            f"{r['next_predicted'] / GIB:.2f}{' (measured)' if r.get('next_measured') else ''}" if r["next"] else "—"]


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
