"""ZeRO-3 on gloo CPU ranks: how much of the parameter all-gather the one-unit prefetch hides.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.zero_prefetch [--dp 4] [--model gpt-125m] [--seq 256]
        [--rounds 3] [--steps 2] [--quick]

Each round launches, in alternating order (A B, B A, …), two sets of --dp ranks of `hybrid.trainer.Trainer`
training --model (cut to --layers layers when given) under `parallel.zero=3`: as built (each unit's all-gather
launched one unit ahead, in the forward and the backward), and with the prefetch switched off inside the ranks
(every all-gather launched where it is waited for: the counterfactual). Each runs one untimed step, then --steps
logged, timed steps (`logging.timing`). Reported per side, the median over rounds: the step time, the DP
all-gathers' seconds from launch to completion (`comm/dp/all_gather/s`), the part the training thread waited
(`comm/dp/all_gather/exposed_s`) and exposed / total (goal: ≤ 0.2 with the prefetch, at gpt-125m dp4).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.zero_common import VOCAB, add_shape, corpus, parse, shape_label
from hybrid.config import compose_config
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp import units
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.zero_prefetch"
QUICK = {"model": "gpt-tiny", "dp": 2, "seq": 64, "rounds": 1, "steps": 1, "timeout": 120.0}
SIDES = ("prefetch", "no_prefetch")
KEYS = ("time/step_s", "comm/dp/all_gather/s", "comm/dp/all_gather/exposed_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny at dp2, 64 tokens, one round of one step, seconds")
    add_shape(p, steps=2)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return parse(build_parser(), argv, QUICK)


def config(args: argparse.Namespace) -> Any:
    layers = [f"model.n_layers={args.layers}"] if args.layers else []
    return compose_config([f"model={args.model}", *layers, "model.dropout=0", f"data.seq_len={args.seq}",
                           f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch * args.dp}",
                           "train.eval_every=0", f"train.steps={args.steps + 1}", f"parallel.dp={args.dp}",
                           "parallel.zero=3", "train.fused_head=off"])


def side_rank(rank: int, world: int, cfg: Any, steps: int, prefetch: bool) -> list[dict[str, float]]:
    """One untimed step, then `steps` timed ones; their records' step time and all-gather figures."""
    if not prefetch:
        units._launch = lambda unit: None  # the counterfactual: each all-gather starts where it is waited for
    ctx = ParallelContext.build(Layout.create(world))
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), corpus(cfg.data.seq_len), torch.device("cpu"))
    trainer.train_step()
    records = [trainer.step_metrics(trainer.train_step(timed=True)) for _ in range(steps)]
    return [{k: r.get(k, 0.0) for k in KEYS} for r in records]


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, list[dict[str, float]]]:
    cfg = config(args)
    got: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for i in range(args.rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            got[side] += launch(side_rank, args.dp, cfg, args.steps, side == "prefetch", timeout=args.timeout)[0]
    out(f"\n## {shape_label(args)}, zero=3; median over {args.rounds} rounds × {args.steps} steps (rank 0's record: "
        "the means over ranks)")
    rows = [[side, *(_median(got[side], k) for k in KEYS), _median_share(got[side])] for side in SIDES]
    out("\n".join(common.table(["side", "step s", "all-gather s", "all-gather exposed s", "exposed / total"], rows)))
    return got


def _median(records: list[dict[str, float]], key: str) -> str:
    return f"{statistics.median(r[key] for r in records):.3f}"


def _median_share(records: list[dict[str, float]]) -> str:
    shares = [r[KEYS[2]] / r[KEYS[1]] for r in records if r[KEYS[1]]]
    return f"{statistics.median(shares):.2f}" if shares else "-"


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
