"""Automatic stage balance on gloo CPU ranks: does `parallel.stage_layers=auto` (layers split by predicted time,
the embedding's and the head's included) train a pipeline faster than equal layer counts, and by what the planner's
simulator predicts?

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.stage_balance --model gpt-125m --pp 2 [--layers 12]
        [--seq 256] [--microbatches 8] [--rounds 3] [--steps 3] [--quick]

Each round launches --pp ranks (pp = world, dp = 1, 1F1B) twice, once per split — equal counts and auto — in
alternating order (A B, B A, …); a launch builds one `Trainer`, runs one untimed step, then --steps timed ones
(`time/step_s`: the slowest rank's). Reported: each split's layers per part, the medians of the step time, the
median over rounds of the paired ratio auto / equal, and the ratio the cost model predicts (each part's microbatch
forward and backward from `hybrid.plan.balance`, replayed by the pipeline simulator). The splits train the same
model on random tokens; their losses agree (tests/dist/test_pp.py holds any split to the single-process reference).
At pp ≤ 2 every rank has a core of its own; above, the ranks share 2 cores and a waiting rank frees its core.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick
from hybrid.bench.tp_overlap import corpus
from hybrid.config import compose_config
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.pp.pipeline import partition_layers
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.parallel.pp.simulator import simulate
from hybrid.plan.balance import auto_stage_layers, part_passes, passes_of
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.stage_balance"
SPLITS = ("equal", "auto")
QUICK = {"model": "gpt-tiny", "layers": 4, "seq": 32, "vocab": 512, "microbatches": 4, "rounds": 1, "steps": 1,
         "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 4 layers, 32 tokens, 1 round of 1 step, seconds")
    p.add_argument("--model", default="gpt-125m", help="a configs/model name")
    p.add_argument("--layers", type=int, default=0, help="layers of the model (0: the model's)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (= ranks)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches of one sequence a step")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary (the head's width)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the splits alternating")
    p.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a launch's ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if args.pp < 2 or min(args.seq, args.microbatches, args.rounds, args.steps, args.vocab) < 1 or args.layers < 0:
        p.error("--pp must be >= 2; --seq, --microbatches, --rounds, --steps, --vocab >= 1; --layers >= 0")
    return args


def config(args: argparse.Namespace) -> Any:
    layers = [f"model.n_layers={args.layers}"] if args.layers else []
    return compose_config([f"model={args.model}", *layers, "model.dropout=0", f"data.seq_len={args.seq}",
                           f"model.max_seq_len={max(args.seq, 1024)}", "train.micro_batch_size=1",
                           f"train.global_batch_size={args.microbatches}", "train.eval_every=0",
                           "train.precision=fp32", "train.device=cpu", "train.fused_head=off", f"parallel.pp={args.pp}",
                           f"model.vocab_size={args.vocab}", f"train.steps={10**6}"])


def splits(cfg: Any, vocab: int) -> dict[str, list[int]]:
    parts = cfg.parallel.pp * cfg.parallel.virtual_stages
    return {"equal": [len(r) for r in partition_layers(cfg.model.n_layers, parts)],
            "auto": auto_stage_layers(cfg, vocab, "cpu")}


def predicted_s(cfg: Any, vocab: int, counts: list[int]) -> float:
    """The step's makespan the cost model and the simulator predict for `counts` layers per part."""
    passes = passes_of(counts, *part_passes(cfg, vocab, "cpu"))
    parts = [one.clocked() for one in passes]
    schedule = build_schedule("1f1b", cfg.parallel.pp, cfg.train.global_batch_size, 1)
    return simulate(schedule, parts=parts).makespan


def split_rank(rank: int, world: int, cfg: Any, vocab: int, steps: int) -> list[float]:
    """`steps` timed step times (the slowest rank's) after one untimed step."""
    ctx = ParallelContext.build(Layout.create(world, pp=world))
    trainer = Trainer(cfg, ctx, build_chunks(cfg, vocab, ctx), corpus(vocab, cfg.data.seq_len), torch.device("cpu"))
    trainer.train_step()
    return [trainer.step_metrics(trainer.train_step(timed=True))["time/step_s"] for _ in range(steps)]


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    base = config(args)
    counts = splits(base, args.vocab)
    got: dict[str, list[list[float]]] = {s: [] for s in SPLITS}
    for i in range(args.rounds):
        for name in SPLITS if i % 2 == 0 else SPLITS[::-1]:
            cfg = _with_split(base, counts[name])
            got[name].append(launch(split_rank, args.pp, cfg, args.vocab, args.steps, timeout=args.timeout)[0])
    predicted = {s: predicted_s(base, args.vocab, counts[s]) for s in SPLITS}
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(got["auto"], got["equal"])]
    out(f"\n## {args.model} ({base.model.n_layers} layers, vocab {args.vocab}), pp={args.pp} 1F1B, "
        f"{args.microbatches} microbatches of 1 × {args.seq} tokens, fp32; {args.rounds} rounds × {args.steps} steps")
    rows = [[s, str(counts[s]), f"{statistics.median(x for r in got[s] for x in r):.3f}",
             f"{predicted[s]:.3f}"] for s in SPLITS]
    out("\n".join(common.table(["split", "layers per part", "step s (median)", "predicted s (cost model)"], rows)))
    measured, model = statistics.median(ratios), predicted["auto"] / predicted["equal"]
    out(f"\nauto / equal step time: measured {measured:.3f} (per round {', '.join(f'{r:.3f}' for r in ratios)}), "
        f"predicted {model:.3f}")
    return {"counts": counts, "got": got, "ratio": measured, "predicted": model}


def _with_split(cfg: Any, counts: list[int]) -> Any:
    out = cfg.copy()
    out.parallel.stage_layers = list(counts)
    return out


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
