"""Training over slow links: what eval loss does each `sync` mode reach, for how many bytes between nodes?

    OMP_NUM_THREADS=1 HYBRID_CACHE=/tmp/hc PYTHONPATH=. python -m hybrid.bench.sync_modes [--quick]

--model (--layers deep) on the default corpus (--max-chars of it and a --vocab BPE where given), dp=4 forked gloo
ranks as 2 emulated nodes × 2 (`parallel.ranks_per_node=2`), the same seed, data, token count and inner
hyperparameters for every run; one real `Trainer` per run. The synchronous baseline averages every step's gradients
hierarchically (`compression=hierarchical`, exact: inside each node, then between them); DiLoCo and local SGD keep
DP inside a node synchronous (`sync.scope=inter`) and exchange between nodes every H steps (fp32, int8 or sign on
the outer step); gossip averages with the ring's neighbours every step; the parameter server (one shard, on node 0)
takes every worker's gradient and returns the parameters, synchronously or 2 versions ahead at most. Inter-node
bytes: the payload a rank hands to its between-node groups (`dp_inter`, as COUNTER counts it), sends to a gossip
neighbour on the other node, or pushes to and pulls from a server there; summed over the run, averaged over ranks.
The final eval loss is over --eval-batches held-out global batches, the same for every run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick, table
from hybrid.bench.inputs import add_size_options, size_overrides
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.data import DP_GROUPS
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.data import Corpus

MODULE = "hybrid.bench.sync_modes"
CPU = torch.device("cpu")
SYNC = ("compression=hierarchical", "compression.inner=none")


class Outer(NamedTuple):
    """An outer Nesterov setting, written LR:MOMENTUM on the command line."""

    lr: float
    momentum: float

    def __str__(self) -> str:
        return f"{self.lr:g}:{self.momentum:g}"


PAPER = Outer(0.7, 0.9)  # DiLoCo's outer Nesterov lr and momentum
GOAL_LOSS, GOAL_BYTES = 0.02, 50.0  # DiLoCo within 2 % of synchronous eval loss at >= 50x fewer inter-node bytes
QUICK = {"steps": 2, "inner_steps": [2], "seq": 32, "micro_batch": 1, "global_batch": 4, "eval_batches": 1,
         "codecs": ["none"], "layers": 1, "vocab": 512, "max_chars": 200_000}


def runs(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], bool]]:
    """(label, overrides, held to the goal) of every run: sync, DiLoCo per outer optimizer × H × codec, local SGD,
    gossip, the parameter server."""
    out = [("sync DP", SYNC, False)]
    for (lr, momentum), tau in ((o, t) for o in args.outer for t in args.overlap_steps):
        tag = ("" if (lr, momentum) == PAPER else f" lr{lr:g} m{momentum:g}") + (f" τ{tau}" if tau else "")
        for h in (h for h in args.inner_steps if tau < h):
            for codec in args.codecs:
                out.append((f"DiLoCo H={h} {codec}{tag}", ("sync=diloco", f"sync.inner_steps={h}", "sync.scope=inter",
                            f"sync.outer_lr={lr}", f"sync.outer_momentum={momentum}", f"compression={codec}",
                            f"sync.overlap_steps={tau}"), h >= 50 or codec != "none"))
    for h in args.local_steps or [args.inner_steps[len(args.inner_steps) // 2]]:
        out.append((f"local SGD H={h}", ("sync=local_sgd", f"sync.inner_steps={h}", "sync.scope=inter"), False))
    out.append(("gossip ring", ("sync=gossip",), False))
    out.append(("PS sync", ("sync=ps",), False))
    out.append(("PS async k=2", ("sync=ps_async",), False))
    return out


def outer_setting(text: str) -> Outer:
    """'LR:MOMENTUM' -> Outer, for --outer."""
    lr, _, momentum = text.partition(":")
    try:
        return Outer(float(lr), float(momentum))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LR:MOMENTUM (e.g. 0.7:0.9), got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "2 steps per run of a 1-layer model on a 200,000-character corpus with a 512-token BPE, "
                    "under a minute")
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--steps", type=int, default=600, help="train.steps (the same tokens for every run)")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50, 100], help="DiLoCo's H values")
    p.add_argument("--codecs", nargs="+", default=["none", "int8", "sign"], help="the outer step's compression")
    p.add_argument("--outer", type=outer_setting, nargs="+", default=[PAPER], metavar="LR:MOMENTUM",
                   help="DiLoCo's outer Nesterov settings to run (default: the paper's 0.7:0.9)")
    p.add_argument("--overlap-steps", type=int, nargs="+", default=[0], help="DiLoCo's sync.overlap_steps values "
                   "(τ < H; default: 0, blocking)")
    p.add_argument("--local-steps", type=int, nargs="+", default=[], help="local SGD's H values (default: the "
                   "middle --inner-steps)")
    p.add_argument("--lr", type=float, default=None, help="train.lr (default: the config's)")
    p.add_argument("--seq", type=int, default=64, help="data.seq_len")
    add_size_options(p)
    p.add_argument("--micro-batch", type=int, default=2, help="train.micro_batch_size")
    p.add_argument("--global-batch", type=int, default=16, help="train.global_batch_size")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out global batches of the final eval")
    p.add_argument("--only", default="", help="comma-separated run labels (default: all; 'sync DP' always runs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before the ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    sizes = (args.steps, *args.inner_steps, *args.local_steps, args.seq, args.micro_batch, args.eval_batches,
             1 if args.layers is None else args.layers)
    if min(sizes) < 1 or min(args.overlap_steps) < 0 or args.global_batch % (args.micro_batch * 4):
        p.error("sizes must be >= 1, --overlap-steps >= 0 and --global-batch a multiple of --micro-batch · 4")
    if any(not (o.lr > 0 and 0 <= o.momentum < 1) for o in args.outer) or len(set(args.outer)) < len(args.outer):
        p.error("--outer takes distinct LR:MOMENTUM pairs with LR > 0 and 0 <= MOMENTUM < 1")
    return args


def mode_config(args: argparse.Namespace, overrides: Sequence[str], steps: Optional[int] = None) -> Config:
    """One run's config: the default corpus, fp32 CPU, dp=4 on 2 emulated nodes, eval only at the end."""
    knobs = size_overrides(args) + ([] if getattr(args, "lr", None) is None else [f"train.lr={args.lr}"])
    return compose_config([f"model={args.model}", "data=default", f"data.seq_len={args.seq}", *knobs,
                           "parallel.ranks_per_node=2", "parallel.name=bench",
                           f"train.micro_batch_size={args.micro_batch}",
                           f"train.global_batch_size={args.global_batch}", f"train.steps={steps or args.steps}",
                           "train.eval_every=0", f"train.eval_batches={getattr(args, 'eval_batches', 1)}",
                           "train.precision=fp32", "train.device=cpu", "logging.progress=false", *overrides])


def mode_rank(rank: int, world: int, cfg: Config, corpus: Corpus) -> dict[str, Any]:
    """Train `cfg` on this rank; the final eval loss, this rank's inter-node and DP bytes, seconds per step, and the
    auto outer step's run state (None unless `sync.outer=auto` chose it)."""
    ctx = ParallelContext.build(validate(cfg, world, 2))
    hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, CPU, hook, state)
    inter = wire = dp = 0
    start = time.perf_counter()
    for _ in range(cfg.train.steps):
        C.COUNTER.reset()
        trainer.train_step()
        inter += C.COUNTER.group_bytes("dp_inter")
        wire += C.COUNTER.wire_bytes("dp_inter")
        dp += sum(C.COUNTER.group_bytes(g) for g in DP_GROUPS)  # the parameter server's pushes and replies too
    wall = time.perf_counter() - start
    p2p = getattr(trainer.dp.replica, "inter_bytes", 0)  # gossip, PS: their point-to-point bytes across nodes
    model = 4 * sum(p.numel() for p in trainer.model.parameters())
    return {"eval": trainer.evaluate(), "inter": inter + p2p, "wire": wire + p2p, "dp": dp,
            "s_per_step": wall / cfg.train.steps, "model": model, "outer": trainer.dp.state_dict().get("sync_outer")}


def mode_ranks(rank: int, world: int, cfgs: list[Config], corpus: Corpus) -> list[dict[str, Any]]:
    """`mode_rank` for each config on the same forked ranks, each from the same RNG state."""
    out = []
    for cfg in cfgs:
        torch.manual_seed(cfg.train.seed)
        out.append(mode_rank(rank, world, cfg, corpus))
    return out


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every run's final eval loss and inter-node bytes, against the synchronous run's."""
    from hybrid.data import prepare_data

    only = {x.strip() for x in args.only.split(",") if x.strip()}
    chosen = [r for r in runs(args) if not only or r[0] in only or r[0] == "sync DP"]
    corpus = prepare_data(mode_config(args, []).data)
    cfgs = [mode_config(args, o) for _, o, _ in chosen]
    results = launch(mode_ranks, 4, cfgs, corpus, timeout=args.timeout * len(cfgs))
    rows = []
    for i, (label, overrides, goal) in enumerate(chosen):
        ranks = [r[i] for r in results]
        rows.append({"label": label, "overrides": list(overrides), "goal": goal, "eval": ranks[0]["eval"],
                     "inter": sum(r["inter"] for r in ranks) / 4, "wire": sum(r["wire"] for r in ranks) / 4,
                     "dp": sum(r["dp"] for r in ranks) / 4,
                     "model": sum(r["model"] for r in ranks) / 4,
                     "s_per_step": max(r["s_per_step"] for r in ranks)})
    print_rows(args, rows, corpus, out)
    return rows


def print_rows(args: argparse.Namespace, rows: list[dict[str, Any]], corpus: Corpus,
               out: Callable[[str], None]) -> None:
    base = rows[0]
    out(f"\n## loss vs inter-node bytes: {args.model} on the default corpus ({len(corpus.train):,} train samples "
        f"of {args.seq}+1 tokens, vocab {corpus.vocab_size}), dp=4 as 2 emulated nodes × 2, {args.steps} steps of "
        f"{args.global_batch} sequences ({args.steps * args.global_batch * args.seq:,} tokens) for every run")
    body = []
    for r in rows:
        rel = (r["eval"] - base["eval"]) / base["eval"]
        fewer = base["wire"] / r["wire"] if r["wire"] else float("inf")
        r |= {"rel": rel, "fewer": fewer, "pass": (abs(rel) <= GOAL_LOSS and fewer >= GOAL_BYTES) if r["goal"]
              else None}
        body.append([r["label"], f"{r['eval']:.4f}", f"{100 * rel:+.2f}%", f"{r['inter'] / 2**20:,.2f}",
                     f"{r['wire'] / 2**20:,.2f}", f"{fewer:,.1f}×", f"{r['dp'] / 2**20:,.1f}",
                     common.verdict(r["pass"]), f"{r['s_per_step']:.3f}"])
    for line in table(["run", "final eval loss", "vs sync", "inter-node payload MiB/rank", "on the wire MiB/rank",
                       "fewer than sync", "all DP MiB/rank", f"≤{GOAL_LOSS:.0%} at ≥{GOAL_BYTES:.0f}×", "s/step"],
                      body):
        out(line)
    out("payload: handed to between-node groups (or gossip's and the server's point-to-point sends to the other "
        "node) over the run, mean over ranks; on the wire: what a rank sends of it (ring factors: an all-reduce "
        "2(n−1)/n of its payload, an all-to-all or all-gather (n−1)/n; n = 2 nodes here: an fp32 all-reduce sends "
        "its payload, int8's all-to-all and all-gather half theirs); fewer than sync: on the wire. All DP: every "
        "DP group's payload (inside nodes too). The goal column holds the DiLoCo runs at H ≥ 50 or with a "
        "compressed outer step to the 2 % / 50× goal.")


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
