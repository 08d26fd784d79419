"""Do `sync=diloco`'s defaults (H and the outer step chosen from the run) stay within 2 % of synchronous DP's eval loss
at ≥ 50× fewer inter-node bytes?

    OMP_NUM_THREADS=1 HYBRID_CACHE=/tmp/hc PYTHONPATH=. python -m hybrid.bench.diloco_defaults [--quick]

--model on the default corpus, dp=4 forked gloo ranks as 2 emulated nodes × 2 (`parallel.ranks_per_node=2`), every
run the same seed (--seed), data and inner AdamW, one real `Trainer` each (`sync_modes.mode_rank`): synchronous DP
(hierarchical, exact: the reference), `sync=diloco` at its defaults (`sync.scope=inter`: DP inside a node every
step, between nodes at the outer steps), the same with each --codecs on the outer exchange, `sync=local_sgd` (H=50,
plain averaging) and the paper's outer step pinned (`sync.outer=nesterov`, the defaults' H). Inter-node bytes: the
payload a rank hands to its between-node groups (`bytes_dp_inter`, the final sync included) and what it sends of
it on the wire (ring factors), summed over the run and averaged over ranks; the goal is held against both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick, table
from hybrid.bench.inputs import add_train_shape
from hybrid.bench.sync_modes import GOAL_BYTES, GOAL_LOSS, SYNC, mode_config, mode_ranks
from hybrid.config import Config
from hybrid.sync.outer_policy import inner_steps, pinned

if TYPE_CHECKING:
    from hybrid.data import Corpus

MODULE = "hybrid.bench.diloco_defaults"
INTER = "sync.scope=inter"
QUICK = {"steps": 4, "seq": 32, "micro_batch": 1, "global_batch": 4, "eval_batches": 1, "layers": 1, "vocab": 512,
         "max_chars": 200_000}


def runs(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...]]]:
    """(label, overrides) of every run: sync DP, the defaults (fp32, then each codec), local SGD, the paper's."""
    out = [("sync DP", SYNC), ("diloco defaults", ("sync=diloco", INTER))]
    out += [(f"diloco defaults, {c}", ("sync=diloco", INTER, f"compression={c}")) for c in args.codecs]
    out += [("local_sgd", ("sync=local_sgd", INTER)),
            ("paper's outer step", ("sync=diloco", INTER, "sync.outer=nesterov"))]
    return out + [also_run(text) for text in args.also]


def also_run(text: str) -> tuple[str, tuple[str, ...]]:
    """'LABEL=OVERRIDE,OVERRIDE' (--also) -> (label, the DiLoCo run's overrides); ValueError when malformed."""
    label, _, overrides = text.partition("=")
    if not label or not overrides:
        raise ValueError(f"--also takes LABEL=OVERRIDE[,OVERRIDE…], got {text!r}")
    return label, ("sync=diloco", INTER, *overrides.split(","))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "4 steps per run of a 1-layer model on a 200,000-character corpus, a 512-token BPE")
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--steps", type=int, default=600, help="train.steps (the same tokens for every run)")
    p.add_argument("--codecs", nargs="*", default=["int8"], help="the defaults again with these outer codecs")
    add_train_shape(p, seq=64, micro_batch=2, global_batch=16)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out global batches of the final eval")
    p.add_argument("--seed", type=int, default=None, help="train.seed (default: the config's)")
    p.add_argument("--lr", type=float, default=None, help="train.lr (default: the config's)")
    p.add_argument("--also", nargs="*", default=[], metavar="LABEL=OVERRIDES", help="more DiLoCo runs "
                   "(sync=diloco sync.scope=inter and these comma-separated overrides), e.g. 'H=10 average="
                   "sync.inner_steps=10,sync.outer=average'")
    p.add_argument("--trace", action="store_true", help="print each auto run's cosine of every outer round")
    p.add_argument("--only", default="", help="comma-separated run labels (default: all; 'sync DP' always runs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before the ranks are killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if min(args.steps, args.seq, args.micro_batch, args.eval_batches) < 1 or args.global_batch % (args.micro_batch * 4):
        p.error("sizes must be >= 1 and --global-batch a multiple of --micro-batch · 4")
    try:
        runs(args)
    except ValueError as e:
        p.error(str(e))
    return args


def config(args: argparse.Namespace, overrides: Sequence[str]) -> Config:
    """`sync_modes.mode_config`, with --seed."""
    return mode_config(args, [*overrides, *([f"train.seed={args.seed}"] if args.seed is not None else [])])


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every run's final eval loss and inter-node bytes against the synchronous run's."""
    from hybrid.data import prepare_data

    only = {x.strip() for x in args.only.split(",") if x.strip()}
    chosen = [r for r in runs(args) if not only or r[0] in only or r[0] == "sync DP"]
    corpus = prepare_data(config(args, []).data)
    cfgs = [config(args, o) for _, o in chosen]
    results = launch(mode_ranks, 4, cfgs, corpus, timeout=args.timeout * len(cfgs))
    rows = [row(label, cfg, [r[i] for r in results]) for i, ((label, _), cfg) in enumerate(zip(chosen, cfgs))]
    judge(rows)
    print_rows(args, rows, corpus, out)
    for r in rows if args.trace else []:
        if r["cosines"]:
            out(f"{r['label']}: cos of consecutive mean pseudo-gradients by round (H={r['h']}): "
                + " ".join(f"{c:.2f}" for c in r["cosines"]))
    return rows


def row(label: str, cfg: Config, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures: rank 0's eval loss (every rank evaluates the one final model), bytes averaged over ranks,
    H and what the outer step did (pinned, or the auto rule's run state at the end)."""
    mean = {k: sum(r[k] for r in ranks) / len(ranks) for k in ("inter", "wire")}
    return {"label": label, "eval": ranks[0]["eval"], **mean, "outer": outer_taken(cfg, ranks[0].get("outer")),
            "cosines": (ranks[0].get("outer") or {}).get("cosines", []),
            "h": inner_steps(cfg.sync, cfg.train.steps) if cfg.sync.mode == "diloco" else 1,
            "s_per_step": max(r["s_per_step"] for r in ranks)}


def outer_taken(cfg: Config, state: Optional[dict[str, Any]]) -> str:
    """The outer step a run took: pinned (lr, momentum), or auto's mode at the end and the step it switched after."""
    if cfg.sync.mode != "diloco":
        return "—"
    if state is None:
        lr, momentum = pinned(cfg.sync) or (0.0, 0.0)
        return "average" if (lr, momentum) == (1.0, 0.0) else f"lr {lr:g} μ {momentum:g}"
    return "auto: average" if state["switch_step"] is None else f"auto: Nesterov after step {state['switch_step']}"


def judge(rows: list[dict[str, Any]]) -> None:
    """Each row against the first (sync DP): the gap, the byte ratios (payload and wire), the goal's verdict."""
    base = rows[0]
    for r in rows:
        r["rel"] = (r["eval"] - base["eval"]) / base["eval"]
        r["fewer"] = base["inter"] / r["inter"] if r["inter"] else float("inf")
        r["fewer_wire"] = base["wire"] / r["wire"] if r["wire"] else float("inf")
        fewer = min(r["fewer"], r["fewer_wire"])
        r["pass"] = None if r is base else bool(r["rel"] <= GOAL_LOSS and fewer >= GOAL_BYTES)


def print_rows(args: argparse.Namespace, rows: list[dict[str, Any]], corpus: Corpus,
               out: Callable[[str], None]) -> None:
    out(f"\n## DiLoCo's defaults: {args.model} on the default corpus ({len(corpus.train):,} train samples of "
        f"{args.seq}+1 tokens), dp=4 as 2 emulated nodes × 2, {args.steps} steps of {args.global_batch} sequences"
        f"{'' if args.seed is None else f', seed {args.seed}'}")
    body = [[r["label"], r["h"], r["outer"], f"{r['eval']:.4f}", f"{100 * r['rel']:+.2f}%",
             f"{r['inter'] / 2**20:,.2f}", f"{r['fewer']:,.1f}×", f"{r['fewer_wire']:,.1f}×",
             common.verdict(r["pass"]), f"{r['s_per_step']:.3f}"] for r in rows]
    for line in table(["run", "H", "outer step", "final eval loss", "vs sync", "inter-node MiB/rank",
                       "fewer (payload)", "fewer (wire)", f"≤{GOAL_LOSS:.0%} at ≥{GOAL_BYTES:.0f}×", "s/step"], body):
        out(line)
    out("payload: `bytes_dp_inter`, what a rank hands to its between-node groups over the run (the final sync "
        "included), mean over ranks; wire: what it sends of it (an fp32 all-reduce between 2 nodes its payload, "
        "int8's all-to-all and all-gather half theirs). The goal column needs both ratios ≥ the goal.")


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
