"""Context parallelism on gloo CPU ranks: how much of the ring's K/V transfer hides behind attention, and the step
time of ring, all-to-all and no CP side by side.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.cp_overlap [--cp 2] [--seq 8192] [--rounds 3] [--quick]

Each round launches, in alternating order (A B C, C B A, …), three sets of ranks of `hybrid.trainer.Trainer`
training --model cut to --layers layers on --batch × --seq-token sequences: `parallel.cp=--cp` with the ring,
with all-to-all, and cp=1 on one rank (the same global batch). Each runs one untimed step, then --steps logged,
timed steps (`logging.timing`: every collective's launch-to-completion span and the time the training thread
waited on it). Reported per side, the median over rounds: the step time, and for the CP sides the cp group's
transfer seconds, its exposed (waited) seconds and `comm/overlap_cp` = 1 − exposed / transfer (goal for the ring:
≥ 0.8 at seq ≥ 8 K). The CP sides' step time over cp=1's is context, not a speed-up claim: on 2 shared cores
the cp ranks split the same cores cp=1 has to itself.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.cp_common import add_shape, parse
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.cp_overlap"
VOCAB = 8192
QUICK = {"seq": 512, "layers": 2, "rounds": 2, "steps": 1, "timeout": 120.0}
SIDES = ("ring", "a2a", "cp1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "512 tokens, 2 rounds of 1 step, seconds")
    p.add_argument("--cp", type=int, default=2, help="CP size of the ring and all-to-all sides")
    add_shape(p)
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the sides alternating")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse(p, argv, QUICK)
    if args.cp < 2 or args.seq % (2 * args.cp) or min(args.layers, args.batch, args.rounds, args.steps) < 1:
        p.error("--cp must be >= 2 with --seq divisible by 2·cp; --layers, --batch, --rounds, --steps >= 1")
    return args


def side_config(args: argparse.Namespace, side: str) -> Any:
    cp = 1 if side == "cp1" else args.cp
    comm = "a2a" if side == "a2a" else "ring"
    return compose_config([f"model={args.model}", f"model.n_layers={args.layers}", "model.dropout=0",
                           f"model.max_seq_len={max(args.seq, 1024)}", f"data.seq_len={args.seq}",
                           f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
                           "train.eval_every=0", f"train.steps={args.steps + 1}", f"parallel.cp={cp}",
                           f"parallel.cp_comm={comm}", "train.fused_head=off"])


def corpus(seq: int, n: int = 16) -> Corpus:
    samples = np.random.default_rng(0).integers(0, VOCAB, size=(n, seq + 1)).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=VOCAB, eos_id=0, train=samples, eval=samples[:2], seq_len=seq)


def side_rank(rank: int, world: int, cfg: Any, steps: int) -> list[dict[str, float]]:
    """One untimed step, then `steps` timed ones; their records' step time and cp figures."""
    layout = Layout.create(world, cp=world) if world > 1 else Layout(world=1)
    ctx = ParallelContext.build(layout)
    data = corpus(cfg.data.seq_len)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), data, torch.device("cpu"))
    trainer.train_step()
    records = [trainer.step_metrics(trainer.train_step(timed=True)) for _ in range(steps)]
    keys = ("time/step_s", "comm/cp/s", "comm/cp/exposed_s", "comm/overlap_cp")
    return [{k: r.get(k, 0.0) for k in keys} for r in records]


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, list[dict[str, float]]]:
    cfgs = {side: side_config(args, side) for side in SIDES}
    got: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for i in range(args.rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            world = 1 if side == "cp1" else args.cp
            got[side] += launch(side_rank, world, cfgs[side], args.steps, timeout=args.timeout)[0]
    out(f"\n## {args.model} cut to {args.layers} layers, {args.batch} × {args.seq} tokens, fp32, cp={args.cp}; "
        f"median over {args.rounds} rounds × {args.steps} steps (rank 0's record: the means over ranks)")
    rows = [[side] + [_median(got[side], k) for k in ("time/step_s", "comm/cp/s", "comm/cp/exposed_s",
                                                        "comm/overlap_cp")] for side in SIDES]
    out("\n".join(common.table(["side", "step s", "cp transfer s", "cp exposed s", "overlap_cp"], rows)))
    return got


def _median(records: list[dict[str, float]], key: str) -> str:
    return f"{statistics.median(r[key] for r in records):.3f}"


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
