"""The longest sequence a model trains on this machine's ranks, with context parallelism and without.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.cp_longest [--model gpt-125m] [--world 8] [--cp 1 8]

For each --cp size, --world gloo ranks (one torch thread each) train --model at `parallel.cp=cp` and
dp = world / cp, one sequence per DP replica, with `parallel.zero=1` and --overrides: one full `Trainer` step
(forward, backward, gradient sync, optimizer) per launch. Memory is the machine's, shared by every rank: a
length fits when the sum of the ranks' peak resident memory stays within --budget-gib (default: what
/proc/meminfo calls available at the start, less a 1.5 GiB margin).

The search measures rather than guesses: launches at --start and 2·--start tokens give the ranks' summed peak
at two lengths; what does not grow with the tokens (the processes, weights, gradients, optimizer state) and
what does (activations: flash attention keeps no score matrix, so they are linear in the tokens) are the
intercept and slope of the line through them. The longest length on the grid (multiples of --grain) that line
predicts to fit is then launched; if it does not fit after all, the next shorter one. Reported: every launch
(length, the ranks' summed peak against the budget, the step time), and per cp size the longest length that
trained within the budget with the next grain's prediction beyond it. A length is never launched past the
prediction: on a machine without swap that would be the kernel's OOM killer, not a measurement.
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


def available_gib() -> float:
    """What the kernel calls available memory now (/proc/meminfo), in GiB."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / GIB


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
    """The ranks' summed peak at `length` tokens on the line through launches `a` and `b` (inf if either
    failed)."""
    return a["total"] + (b["total"] - a["total"]) * (length - a["seq"]) / (b["seq"] - a["seq"])


def search(args: argparse.Namespace, cp: int, budget: float, out: Callable[[str], None]) -> dict[str, Any]:
    """Measure at --start and twice it, launch the longest predicted to fit, step down until one fits."""
    runs = [_launch(args, cp, n, budget, out) for n in (args.start, 2 * args.start)]
    grid = range(args.grain, args.max + 1, args.grain)
    fitting = [n for n in grid if n > 2 * args.start and predicted(runs[0], runs[1], n) <= budget]
    for length in reversed(fitting):
        runs.append(_launch(args, cp, length, budget, out))
        if runs[-1]["fits"]:
            break
    done = [r for r in runs if r["fits"]]
    last = max(done, key=lambda r: r["seq"], default=runs[0])
    beyond = last["seq"] + args.grain  # predicted on the widest measured span: the first launch to the longest
    far = last if last["seq"] != runs[0]["seq"] else runs[1]
    return {"cp": cp, "runs": runs, "longest": last["seq"] if done else 0, "next": beyond,
            "next_predicted": predicted(runs[0], far, beyond)}


def _launch(args: argparse.Namespace, cp: int, seq: int, budget: float, out: Callable[[str], None]) -> dict[str, Any]:
    try:
        ranks = launch(step_rank, args.world, config(args, cp, seq), timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 — a rank killed (out of memory) or timed out: this length did not train
        out(f"  cp={cp} seq={seq}: failed: {str(e).splitlines()[0][:200]}")
        return {"cp": cp, "seq": seq, "ranks": [], "total": float("inf"), "fits": False, "step_s": float("nan")}
    total = sum(r["peak"] for r in ranks)
    row = {"cp": cp, "seq": seq, "ranks": ranks, "total": total, "fits": total <= budget,
           "step_s": max(r["step_s"] for r in ranks)}
    out(f"  cp={cp} seq={seq}: ranks' peak {total / GIB:.2f} GiB of {budget / GIB:.2f}, step {row['step_s']:.1f} s")
    return row


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    budget = (args.budget_gib if args.budget_gib is not None else available_gib() - MARGIN_GIB) * GIB
    out(f"\n## {args.model} on {args.world} ranks, one sequence per DP replica, ZeRO-1, {' '.join(args.overrides)}; "
        f"budget {budget / GIB:.2f} GiB for the ranks' summed peak resident memory")
    results = [search(args, cp, budget, out) for cp in args.cp]
    rows = [[f"cp{r['cp']} dp{args.world // r['cp']}", f"{r['longest']:,}",
             f"{next(x['total'] for x in r['runs'] if x['seq'] == r['longest']) / GIB:.2f}" if r["longest"] else "—",
             f"{r['next']:,}", f"{r['next_predicted'] / GIB:.2f}"] for r in results]
    out("\n".join(common.table(["layout", "longest tokens", "its peak GiB", "next", "next predicted GiB"], rows)))
    return results


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
