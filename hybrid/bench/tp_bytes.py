"""Tensor parallelism on gloo CPU ranks: TP bytes of one training step per op, counted against the formula.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.tp_bytes [--tp 2 4] [--quick]

One `Trainer.train_step` at tp=t (dp=1) for every --tp, without and with sequence parallelism: `COUNTER`
bytes of group "tp" per op against `tp_bytes_per_microbatch` × microbatches, plus per step the SP gradient
all-reduce (`sequence_parallel_grad_elements` × 4) and the 4-byte grad-norm all-reduce.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from hybrid.bench import common
from hybrid.bench.common import launch, parse_with_quick
from hybrid.bench.inputs import resolve_vocab, synthetic_corpus
from hybrid.bench.tp_common import add_train_options, check_train_options, make_trainer, train_cfg
from hybrid.data import Corpus
from hybrid.model.traffic import tp_bytes_per_step
from hybrid.parallel import collectives as C

if TYPE_CHECKING:
    from hybrid.config import Config

MODULE = "hybrid.bench.tp_bytes"
QUICK = {"tp": [2], "vocab": 512, "seq": 16, "micro_batch": 2, "global_batch": 4, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "tp=2 only, 4 × 16 tokens, vocabulary 512, seconds")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP sizes (at least 2)")
    add_train_options(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take under a minute on 2 cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    if min(args.tp) < 2:
        p.error("--tp must be >= 2")
    check_train_options(p, args, dp=1, tp=max(args.tp))
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def bytes_rank(rank: int, world: int, cfg: Config, corpus: Corpus) -> list[dict[str, Any]]:
    """COUNTER's "tp" bytes per op of one train_step at tp=world, without and with SP."""
    rows = []
    for sp in (False, True):
        trainer = make_trainer(cfg, corpus, world, world, sp)
        C.COUNTER.reset()
        trainer.train_step()
        counted = {op: b for (g, op), b in C.COUNTER.bytes.items() if g == "tp"}
        rows.append({"tp": world, "sp": sp, "counted": counted, "microbatches": trainer.num_microbatches,
                     "wire": C.COUNTER.wire_bytes("tp")})
    return rows


def section_bytes_tp(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Counted vs analytic TP bytes of one step at every --tp, with and without SP."""
    cfg = train_cfg(args, 1)
    corpus = synthetic_corpus(resolve_vocab(cfg, args.vocab), args.seq, max(64, 4 * args.global_batch))
    rows = []
    for t in sorted(set(args.tp)):
        rows += launch(bytes_rank, t, cfg, corpus, timeout=args.timeout)[0]
    out(f"\n## bytes_tp per step: {args.model}, step = {args.global_batch} seqs × {args.seq} tokens, micro batch "
        f"{args.micro_batch}, dp=1 (COUNTER payload bytes of group 'tp' on one rank vs traffic.py's formula)")
    out("config  | op             | counted      | analytic     | equal")
    out("--------|----------------|--------------|--------------|------")
    for r in rows:
        r["analytic"] = tp_bytes_per_step(cfg.model, args.micro_batch, args.seq, r["tp"], r["sp"], r["microbatches"])
        name = f"tp{r['tp']}" + ("+SP" if r["sp"] else "")
        for op in sorted(set(r["counted"]) | set(r["analytic"])) + ["total"]:
            c = sum(r["counted"].values()) if op == "total" else r["counted"].get(op, 0)
            a = sum(r["analytic"].values()) if op == "total" else r["analytic"].get(op, 0)
            out(f"{name:7s} | {op:14s} | {c:12d} | {a:12d} | {c == a}")
        out(f"{name:7s} | ring wire bytes one rank sends: {r['wire']:.0f} (all-reduce 2(t−1)/t, others (t−1)/t)")
        r["equal"] = r["counted"] == r["analytic"]
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_bytes_tp, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when a counted TP byte figure differs from the analytic one."""
    return 0 if all(r["equal"] for r in run(parse_args(argv))) else 1


if __name__ == "__main__":
    sys.exit(main())
