"""Pipeline parallelism on gloo CPU ranks: PP bytes of one training step on every rank, counted against the formula.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp_bytes [--quick]

One `Trainer.train_step` per layout (pp2, pp4, tp2pp2 ± SP; 1f1b and interleaved v=2): `COUNTER` bytes of group
"pp" on every rank vs `pp_bytes_per_step`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

from hybrid.bench import common
from hybrid.bench.common import launch, parse_with_quick
from hybrid.bench.inputs import synthetic_corpus
from hybrid.bench.pp_common import CPU, add_run_options, bench_cfg, check_run_options, pp_context
from hybrid.compression.hooks import make_hook
from hybrid.model.traffic import pp_bytes_per_step
from hybrid.parallel import collectives as C
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.pp_bytes"
BYTES_LAYOUTS = ((1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True))  # (tp, pp, sequence parallel)
QUICK = {"vocab": 300, "seq": 16, "micro_batch": 1, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "tiny sizes, seconds")
    add_run_options(p, layers=8, layers_help="model.n_layers (pp4 × v2 = 8 parts)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults take about half a minute on 2 idle cores."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_run_options(p, args, min_layers=8)
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def bytes_cfgs(args: argparse.Namespace, world: int, gbs: int) -> list[Any]:
    """The configs of every BYTES_LAYOUTS entry on `world` ranks × (1f1b, interleaved v=2)."""
    return [bench_cfg(args, f"model.n_layers={args.layers}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                      f"parallel.schedule={name}", f"parallel.virtual_stages={v}", "train.steps=1",
                      f"parallel.sequence_parallel={str(sp).lower()}", f"train.global_batch_size={gbs}")
            for tp, pp, sp in BYTES_LAYOUTS if tp * pp == world for name, v in (("1f1b", 1), ("interleaved", 2))]


def bytes_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any], gbs: int) -> list[dict[str, Any]]:
    """COUNTER's "pp" bytes of one Trainer.train_step for every config."""
    rows = []
    corpus = synthetic_corpus(args.vocab, args.seq, 4 * gbs)
    for cfg in cfgs:
        p = cfg.parallel
        ctx = pp_context(cfg, world)
        hook, state = make_hook(cfg.compression, ctx.dp_group)
        trainer = Trainer(cfg, ctx, build_chunks(cfg, args.vocab, ctx), corpus, CPU, hook, state)
        C.COUNTER.reset()
        trainer.train_step()
        counted = {op: n for (g, op), n in C.COUNTER.bytes.items() if g == "pp"}
        analytic = pp_bytes_per_step(args.micro_batch, args.seq, cfg.model.hidden, p.tp, p.sequence_parallel,
                                     trainer.num_microbatches, p.pp, p.virtual_stages, ctx.pp_rank)
        rows.append({"tp": p.tp, "pp": p.pp, "sp": p.sequence_parallel, "schedule": p.schedule,
                     "v": p.virtual_stages, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
                     "m": trainer.num_microbatches, "counted": counted, "analytic": analytic,
                     "equal": counted == analytic})
    return rows


def section_bytes_pp(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Counted vs analytic PP bytes per step on every rank of pp2, pp4, tp2pp2 and tp2pp2+SP."""
    gbs, rows, h = 4 * args.micro_batch, [], bench_cfg(args).model.hidden
    for world in sorted({tp * pp for tp, pp, _ in BYTES_LAYOUTS}):
        rows += [r for rank_rows in launch(bytes_rank, world, args, bytes_cfgs(args, world, gbs),
                                           gbs, timeout=args.timeout) for r in rank_rows]
    rows.sort(key=lambda r: (BYTES_LAYOUTS.index((r["tp"], r["pp"], r["sp"])), r["v"], r["pp_rank"], r["tp_rank"]))
    out(f"\n## bytes_pp per step: {args.model} with {args.layers} layers, m = 4 microbatches × "
        f"{args.micro_batch} × {args.seq} tokens, dp=1 (COUNTER payload of group 'pp' vs traffic.pp_bytes_per_step)")
    out("layout     | schedule        | pp rank | send_fwd  | send_bwd  | all_reduce | counted   | analytic  | equal "
        "| per boundary per mb per direction")
    out("-----------|-----------------|---------|-----------|-----------|------------|-----------|-----------|-------"
        "|----------------------------------")
    for r in rows:
        if r["tp_rank"]:
            continue  # TP ranks of a stage send the same (checked in `equal` for all)
        c, a = r["counted"], r["analytic"]
        layout = (f"tp{r['tp']}" if r["tp"] > 1 else "") + f"pp{r['pp']}" + ("+SP" if r["sp"] else "")
        seq = args.seq // r["tp"] if r["sp"] else args.seq
        label = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        out(f"{layout:10s} | {label:15s} | {r['pp_rank']:7d} | {c.get('send_fwd', 0):9d} | {c.get('send_bwd', 0):9d} "
            f"| {c.get('all_reduce', 0):10d} | {sum(c.values()):9d} | {sum(a.values()):9d} | {str(r['equal']):5s} | "
            f"b·{'s/t' if r['sp'] else 's'}·h·4 = {args.micro_batch}·{seq}·{h}·4 = "
            f"{args.micro_batch * seq * h * 4}")
    out(f"all {len(rows)} rank rows (every TP rank included) equal: {all(r['equal'] for r in rows)}; all_reduce is "
        "the grad norm's fp32 scalar over PP; the tied embedding's gradient goes over the 'embedding' group.")
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_bytes_pp, args, reproduce_command(args), MODULE, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when a counted PP byte figure differs from the analytic one."""
    return 0 if all(r["equal"] for r in run(parse_args(argv))) else 1


if __name__ == "__main__":
    sys.exit(main())
