"""Context parallelism on gloo CPU ranks: how much memory a CP rank's step needs, against cp=1 and the estimate.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.cp_memory [--cp 1 2 4] [--seq 8192] [--quick]

For each cp, cp forked ranks (one torch thread each) build --model cut to --layers layers, each rank its
load-balanced share of a --batch × --seq sequence (`parallel.cp_comm` --comm), and run one training forward
(loss included) and backward. Per rank: the bytes autograd saves for the backward (`saved_tally`, parameters
excluded) and the peak of CPU tensor memory over the forward and backward (`tracked_peak`, the profiler's
allocation records: activations, gradients and every transient — the ring's K/V in flight and its blocks' fp32
scores). Reported: the largest rank's, their ratio to cp=1 (goal: cp4 ≤ 0.3× cp1), and `hybrid.memory`'s
estimate of what a rank keeps (layers and ends at seq / cp tokens).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.cp_common import add_shape, parse
from hybrid.config import ModelConfig, compose_config
from hybrid.memory_terms import Micro, ends_bytes, layer_activation_bytes
from hybrid.model import build_model
from hybrid.model.context_parallel import ContextParallel
from hybrid.parallel import collectives as C
from hybrid.parallel.cp.sharding import shard
from hybrid.testing.activations import saved_tally, tracked_peak

MODULE = "hybrid.bench.cp_memory"
MB = 2**20
VOCAB = 8192
QUICK = {"cp": [1, 2], "seq": 512, "layers": 2, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "cp 1 and 2 at 512 tokens, seconds")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes (1 is the reference)")
    p.add_argument("--comm", default="ring", choices=("ring", "a2a"), help="parallel.cp_comm")
    add_shape(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse(p, argv, QUICK)
    if min(args.cp) < 1 or min(args.layers, args.seq, args.batch) < 1 or any(args.seq % (2 * c) for c in args.cp):
        p.error("--cp, --layers, --seq and --batch must be >= 1, and --seq divisible by 2·cp for every --cp")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return compose_config([f"model={args.model}", f"model.n_layers={args.layers}", "model.dropout=0",
                           f"model.max_seq_len={max(args.seq, 1024)}"]).model


def step_rank(rank: int, world: int, cfg: ModelConfig, batch: int, seq: int, comm: str) -> dict[str, int]:
    """One forward and backward of this CP rank's tokens: bytes saved for the backward, and the peak."""
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, seed=0).train()
    if world > 1:
        model.set_context_parallel(ContextParallel(dist.group.WORLD, comm))
        C.name_group(dist.group.WORLD, "cp")
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = (shard(t, world, rank) for t in (ids[:, :-1], ids[:, 1:]))
    with saved_tally(model) as seen:
        loss = model(x, y)
    saved = sum(n for _, n in seen.values())
    del loss

    def step() -> None:
        model(x, y).backward()

    return {"saved": saved, "peak": tracked_peak(step)}


def estimate(cfg: ModelConfig, batch: int, seq: int, cp: int, comm: str = "ring") -> int:
    """`hybrid.memory`'s kept bytes of one microbatch at seq / cp tokens (fp32, CPU, the unfused head)."""
    m = Micro(batch, seq // cp, cp=cp, cp_comm=comm)
    return cfg.n_layers * layer_activation_bytes(cfg, m) + ends_bytes(cfg, m, VOCAB, True, True)


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    cfg = model_config(args)
    rows = []
    for cp in sorted(set(args.cp) | {1}):
        per_rank = launch(step_rank, cp, cfg, args.batch, args.seq, args.comm, timeout=args.timeout)
        rows.append({"cp": cp, "saved": max(r["saved"] for r in per_rank), "peak": max(r["peak"] for r in per_rank),
                     "estimate": estimate(cfg, args.batch, args.seq, cp, args.comm)})
    base = rows[0]
    out(f"\n## {args.model} cut to {args.layers} layers, vocab {VOCAB}, {args.batch} × {args.seq} tokens, fp32, "
        f"cp_comm={args.comm}; per rank, the largest rank's")
    cols = ["cp", "saved MiB", "estimate MiB", "saved/est", "peak MiB", "saved vs cp1", "peak vs cp1"]
    out("\n".join(common.table(cols, [[r["cp"], f"{r['saved'] / MB:.1f}", f"{r['estimate'] / MB:.1f}",
                                        f"{r['saved'] / r['estimate']:.3f}", f"{r['peak'] / MB:.1f}",
                                        f"{r['saved'] / base['saved']:.3f}×", f"{r['peak'] / base['peak']:.3f}×"]
                                       for r in rows])))
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
