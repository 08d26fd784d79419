"""Training over slow links: how much wall-clock per token does each `sync` mode lose to a slow link between
nodes, or to one slow rank, against synchronous DP?

    OMP_NUM_THREADS=1 HYBRID_CACHE=/tmp/hc PYTHONPATH=. python -m hybrid.bench.sync_slow_links [--quick]

dp=4 forked gloo ranks as 2 emulated nodes × 2, one `Trainer` per mode built once (sync DP hierarchical and
exact, DiLoCo and local SGD between nodes every H steps, gossip on a ring), each timed for --steps steps per
block, in rounds whose order alternates (ABC…, …CBA), under three conditions:

- **none**: this machine as it is;
- **slow link**: after each step every rank sleeps what its inter-node payload would take on a link of
  --latency-ms per call and --bandwidth-mbs MB/s (the bytes COUNTER counted on `dp_inter`, or gossip's sends to
  the other node): the exchanges here block, so the delay adds as it would on such a link;
- **slow rank**: rank 3 sleeps --straggle-ms after each step's compute (a persistently slower replica).

It prints, per condition and mode, the median seconds per step and the median over rounds of the per-round
ratio to synchronous DP's (< 1: faster than sync).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import launch, parse_with_quick, table
from hybrid.bench.inputs import add_train_shape
from hybrid.bench.sync_modes import SYNC, mode_config
from hybrid.compression.hooks import make_hook
from hybrid.config import Config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.data import Corpus

MODULE = "hybrid.bench.sync_slow_links"
CONDITIONS = ("none", "slow link", "slow rank")
SLOW_RANK = 3
QUICK = {"steps": 1, "rounds": 2, "inner_steps": 2, "seq": 32, "micro_batch": 1, "global_batch": 4, "straggle_ms": 20.0,
         "layers": 1, "vocab": 512, "max_chars": 200_000}


def modes(h: int) -> list[tuple[str, tuple[str, ...]]]:
    return [("sync DP", SYNC), (f"DiLoCo H={h}", ("sync=diloco", f"sync.inner_steps={h}", "sync.scope=inter")),
            (f"DiLoCo H={h} int8", ("sync=diloco", f"sync.inner_steps={h}", "sync.scope=inter", "compression=int8")),
            (f"local SGD H={h}", ("sync=local_sgd", f"sync.inner_steps={h}", "sync.scope=inter")),
            ("gossip ring", ("sync=gossip",)), ("PS async k=2", ("sync=ps_async",))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "1 step per block, 2 rounds, a 20 ms straggler, a 1-layer model on a 200,000-character "
                    "corpus with a 512-token BPE: under half a minute")
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (a multiple of H keeps the outer "
                   "steps' share exact)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of every mode, order alternating")
    p.add_argument("--inner-steps", type=int, default=10, help="DiLoCo's and local SGD's H")
    p.add_argument("--latency-ms", type=float, default=5.0, help="the slow link's latency per call")
    p.add_argument("--bandwidth-mbs", type=float, default=100.0, help="the slow link's bandwidth, MB/s")
    p.add_argument("--straggle-ms", type=float, default=200.0, help="the slow rank's extra time per step")
    add_train_shape(p, seq=64, micro_batch=2, global_batch=16)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    if min(args.steps, args.rounds, args.inner_steps, args.seq, args.micro_batch,
           1 if args.layers is None else args.layers) < 1 \
            or args.global_batch % (args.micro_batch * 4):
        p.error("sizes must be >= 1 and --global-batch a multiple of --micro-batch · 4")
    return args


def delay(args: argparse.Namespace, condition: str, rank: int, inter_bytes: int, inter_calls: int) -> float:
    """Seconds this rank sleeps after a step under `condition`."""
    if condition == "slow link":
        return inter_calls * args.latency_ms / 1e3 + inter_bytes / (args.bandwidth_mbs * 1e6)
    return args.straggle_ms / 1e3 if condition == "slow rank" and rank == SLOW_RANK else 0.0


def block(args: argparse.Namespace, trainer: Trainer, condition: str, rank: int) -> float:
    """Seconds for --steps steps of `trainer` under `condition` (the sleeps included)."""
    start = time.perf_counter()
    for _ in range(args.steps):
        C.COUNTER.reset()
        gossip_before = getattr(trainer.dp.replica, "inter_bytes", 0)
        trainer.train_step()
        calls = sum(n for (g, _), n in C.COUNTER.calls.items() if g == "dp_inter")
        sent = C.COUNTER.group_bytes("dp_inter") + getattr(trainer.dp.replica, "inter_bytes", 0) - gossip_before
        if getattr(trainer.dp.replica, "inter_bytes", 0) > gossip_before:
            calls += 1
        time.sleep(delay(args, condition, rank, sent, calls))
    return time.perf_counter() - start


def slow_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Config], corpus: Corpus
              ) -> dict[str, list[list[float]]]:
    """Rank function: every mode's trainer, then per condition and round each mode's block time (order alternating)."""
    trainers = []
    for cfg in cfgs:
        torch.manual_seed(cfg.train.seed)
        ctx = ParallelContext.build(validate(cfg, world, 2))
        hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
        trainers.append(Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, torch.device("cpu"),
                                hook, state))
    out: dict[str, list[list[float]]] = {c: [[] for _ in cfgs] for c in CONDITIONS}
    for condition in CONDITIONS:
        for r in range(args.rounds):
            order = range(len(cfgs)) if r % 2 == 0 else reversed(range(len(cfgs)))
            for i in order:
                out[condition][i].append(block(args, trainers[i], condition, rank))
    return out


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Per condition and mode: median s/step and the median per-round ratio to synchronous DP."""
    from hybrid.data import prepare_data

    chosen = modes(args.inner_steps)
    steps = args.steps * args.rounds * len(CONDITIONS) + 1
    cfgs = [mode_config(args, o, steps) for _, o in chosen]
    corpus = prepare_data(cfgs[0].data)
    times = launch(slow_rank, 4, args, cfgs, corpus, timeout=args.timeout)[0]  # rank 0's clock: blocks end together
    tokens = args.steps * args.global_batch * args.seq
    out(f"\n## wall-clock per token under a slow link or a slow rank: {args.model}, dp=4 as 2 emulated nodes × 2, "
        f"blocks of {args.steps} steps ({tokens:,} tokens), {args.rounds} rounds per condition; slow link "
        f"{args.latency_ms:g} ms + {args.bandwidth_mbs:g} MB/s, slow rank {SLOW_RANK} +{args.straggle_ms:g} ms/step")
    body = []
    for condition in CONDITIONS:
        base = times[condition][0]
        for (label, _), blocks in zip(chosen, times[condition]):
            ratio = statistics.median(b / s for b, s in zip(blocks, base))
            body.append([condition, label, f"{statistics.median(blocks) / args.steps:.3f}",
                         f"{1e6 * statistics.median(blocks) / tokens:.1f}", f"{ratio:.3f}×"])
    for line in table(["condition", "mode", "s/step (median)", "µs/token", "vs sync DP (median paired)"], body):
        out(line)
    return times


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns rank 0's block times (for tests)."""
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
