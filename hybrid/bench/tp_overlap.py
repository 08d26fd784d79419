"""TP communication overlap on gloo CPU ranks: how much of TP's exchange time each `parallel.tp_overlap` mode
hides, and what it does to the step — none (blocking), bulk and chunked side by side in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.tp_overlap --model gpt-125m --tp 2 [--layers 12]
        [--seq 512] [--rounds 3] [--steps 2] [--chunks 0] [--quick]

One launch of --tp ranks (tp = world, sequence parallelism on, dp = 1) trains one `Trainer` on --model (cut to
--layers layers; 0: all) and switches its TP layers between the modes (`CausalLM.set_tp_overlap`): each round
runs every mode in alternating order (A B C, C B A, …), one untimed step after the switch, then --steps logged,
timed steps (`train_step(timed=True)`: every collective and ring hop's launch-to-completion span, and the time the
training thread waited on it). Reported per mode, the medians over rounds and steps of the step time, the TP
group's exchange seconds, its exposed (waited) seconds and `comm/overlap_tp`; and per round, side by side, the
ratios of exposed TP time and of step time to the blocking mode's (their medians: the goal is chunked's exposed
TP time ≤ 30 % of blocking's). The modes train one model on random tokens, one after another: its loss is no
figure here (tests/dist/test_tp_overlap.py holds the modes' steps equal).
Above 2 ranks the ranks share 2 cores: the gloo threads that move a hop compete with the GEMMs it hides behind.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.tp.comm import TPOverlap
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.tp_overlap"
MODES = ("none", "bulk", "chunked")
KEYS = ("time/step_s", "comm/tp/s", "comm/tp/exposed_s", "comm/overlap_tp")
OPS = ("all_gather", "regather", "reduce_scatter", "all_reduce")  # the TP ops whose exposed seconds are shown
QUICK = {"model": "gpt-tiny", "layers": 2, "seq": 32, "vocab": 512, "rounds": 2, "steps": 1, "timeout": 120.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 2 layers, 32 tokens, 2 rounds of 1 step, seconds")
    p.add_argument("--model", default="gpt-125m", help="a configs/model name")
    p.add_argument("--layers", type=int, default=0, help="layers of the model (0: the model's)")
    p.add_argument("--tp", type=int, default=2, help="TP size (= ranks)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch (one microbatch a step)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the random tokens")
    p.add_argument("--chunks", type=int, default=0, help="pieces of the sequence under chunked (0: tp)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the modes alternating")
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    chunks = args.chunks or args.tp
    if args.tp < 2 or min(args.seq, args.batch, args.rounds, args.steps, args.vocab) < 1 or args.layers < 0:
        p.error("--tp must be >= 2; --seq, --batch, --rounds, --steps, --vocab >= 1; --layers >= 0")
    if chunks % args.tp or args.seq % chunks:
        p.error(f"--chunks ({chunks}) must be a multiple of --tp dividing --seq")
    return args


def config(args: argparse.Namespace) -> Any:
    layers = [f"model.n_layers={args.layers}"] if args.layers else []
    return compose_config([f"model={args.model}", *layers, "model.dropout=0", f"data.seq_len={args.seq}",
                           f"model.max_seq_len={max(args.seq, 1024)}", f"train.micro_batch_size={args.batch}",
                           f"train.global_batch_size={args.batch}", "train.eval_every=0", "train.precision=fp32",
                           "train.device=cpu", "train.fused_head=off", f"parallel.tp={args.tp}",
                           "parallel.sequence_parallel=true", "parallel.tp_overlap=chunked",
                           f"parallel.tp_overlap_chunks={args.chunks}", f"train.steps={10**6}"])


def corpus(vocab: int, seq: int, n: int = 64) -> Corpus:
    samples = np.random.default_rng(0).integers(0, vocab, size=(n, seq + 1)).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples, eval=samples[:2], seq_len=seq)


def overlap_rank(rank: int, world: int, cfg: Any, vocab: int, rounds: int, steps: int
                 ) -> dict[str, list[dict[str, float]]]:
    """Every mode's timed steps' figures, the modes alternating round by round on one model."""
    ctx = ParallelContext.build(Layout.create(world, tp=world))
    data = corpus(vocab, cfg.data.seq_len)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, vocab, ctx), data, torch.device("cpu"))
    got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            for chunk in trainer.model:
                chunk.set_tp_overlap(TPOverlap(mode, cfg.parallel.tp_overlap_chunks))
            trainer.train_step()  # untimed, after the switch
            for _ in range(steps):
                r = trainer.train_step(timed=True)
                record = trainer.step_metrics(r)
                got[mode].append({k: record.get(k, 0.0) for k in (*KEYS, *map(_exposed, OPS))})
    return got


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    cfg = config(args)
    got = launch(overlap_rank, args.tp, cfg, args.vocab, args.rounds, args.steps, timeout=args.timeout)[0]
    layers = cfg.model.n_layers
    out(f"\n## {args.model} ({layers} layers), tp={args.tp} with SP, {args.batch} × {args.seq} tokens, fp32, "
        f"chunks={args.chunks or args.tp}; median over {args.rounds} rounds × {args.steps} steps (rank 0's record: "
        "the means over ranks)")
    rows = [[m, *(f"{_median(got[m], k):.3f}" for k in KEYS)] for m in MODES]
    out("\n".join(common.table(["mode", "step s", "tp exchange s", "tp exposed s", "overlap_tp"], rows)))
    out("\n".join(common.table(["mode", *(f"{op} exposed s" for op in OPS)],
                               [[m, *(f"{_median(got[m], _exposed(op)):.3f}" for op in OPS)] for m in MODES])))
    ratios = {m: _ratios(got, m) for m in MODES[1:]}
    out("\n".join(common.table(["mode", "exposed TP / none's", "step / none's"],
                               [[m, f"{e:.3f}", f"{s:.3f}"] for m, (e, s) in ratios.items()])))
    verdict = "met" if ratios["chunked"][0] <= 0.3 else "NOT met"
    out(f"\nchunked's exposed TP time {ratios['chunked'][0]:.2f}× blocking's (goal ≤ 0.30): {verdict}")
    return {"got": got, "ratios": ratios}


def _exposed(op: str) -> str:
    return f"comm/tp/{op}/exposed_s"


def _median(records: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def _ratios(got: dict[str, list[dict[str, float]]], mode: str) -> tuple[float, float]:
    """Medians over the paired steps of (exposed TP time, step time) relative to the blocking mode's."""
    pairs = list(zip(got[mode], got["none"]))
    exposed = statistics.median(a["comm/tp/exposed_s"] / max(b["comm/tp/exposed_s"], 1e-12) for a, b in pairs)
    return exposed, statistics.median(a["time/step_s"] / b["time/step_s"] for a, b in pairs)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
