"""The planner against measured steps on this machine: layouts of one model trained on gloo CPU ranks, each step
time measured and predicted (`hybrid-plan`'s model, its device calibrated here).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.plan_cpu [--model gpt-125m] [--layers 4] [--world 8]
        [--seq 256] [--batch 16] [--steps 2] [--rounds 1] [--layouts "tp2pp2dp2 mb2 none zero1" …]
        [--nodes 2 --inter-gbs 0.1 --inter-latency-ms 1] [--quick]

The device is calibrated here (`plan.calibrate`: the GEMM rate at the model's MLP shape, attention, copy bandwidth,
an op's fixed cost, then fitted to one of the model's blocks at two sizes, and its optimizer step, run in --world
processes at once: the ranks share the machine's cores); the link inside a node is measured in the first launch
(`plan.probe`: a 16 MiB all-reduce's bus bandwidth, and a hop's latency under load). With `--nodes N` the ranks
form N emulated nodes (`parallel.ranks_per_node`) joined by a link slowed to --inter-gbs and --inter-latency-ms
(`bench.emulated_link`); the planner sees N nodes sharing the cores evenly and, between them, that link.

Each layout is one launch of --world ranks training a real `Trainer` (fp32, sequence parallelism and chunked TP
overlap where tp > 1) for one untimed and --steps timed steps between barriers, once a round for --rounds rounds
(the layouts' order alternating); its measured step is the median over rounds of each launch's median, and with
more than one round the report adds how well the rounds' own orders agree (the ceiling of any prediction's).
Reported per layout: measured and predicted seconds and their ratio; over all: Spearman's rank correlation (goal ≥
0.9), the median absolute error (goal ≤ 15 %), and whether the layout predicted fastest is within 5 % of the
fastest measured.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.emulated_link import SlowLink, install
from hybrid.bench.inputs import synthetic_corpus
from hybrid.config import compose_config
from hybrid.model import build_model
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.plan.balance import resolve
from hybrid.plan.calibrate import calibrate
from hybrid.plan.cost import shape_of
from hybrid.plan.hardware import Cluster, Device, Link
from hybrid.plan.predict import Candidate, predict
from hybrid.plan.probe import node_group
from hybrid.plan.probe import probe as link_probe
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.plan_cpu"
VOCAB = 8192
LAYOUTS = ["tp1pp1dp8 mb2 none zero0", "tp1pp1dp8 mb2 none zero1", "tp2pp1dp4 mb2 none zero1",
           "tp4pp1dp2 mb2 none zero1", "tp1pp2dp4 mb2 none zero1", "tp1pp4dp2 mb1 none zero1",
           "tp2pp2dp2 mb2 none zero1", "tp2pp2dp2 v2 mb1 none zero1", "tp1pp1dp8 mb2 full zero1",
           "tp2pp1dp4 mb4 selective zero1", "tp4pp2dp1 mb4 none zero0", "tp1pp2dp4 mb1 full zero1"]
QUICK = {"model": "gpt-tiny", "layers": 2, "world": 2, "seq": 64, "batch": 4, "steps": 1, "rounds": 2,
         "layouts": ["tp1pp1dp2 mb2 none zero0", "tp2pp1dp1 mb2 none zero0"]}


def parse_layout(text: str) -> Candidate:
    """'tp2pp2dp2 v2 mb1 none zero1' → its Candidate."""
    import re

    m = re.fullmatch(r"tp(\d+)pp(\d+)dp(\d+)(?: v(\d+))? mb(\d+) (none|selective|full) zero(\d)"
                     r"(?: (flat|hierarchical|int8))?", text.strip())
    if not m:
        raise ValueError(f"layout {text!r} is not like 'tp2pp2dp2 v2 mb1 none zero1' (then optionally the DP "
                         "exchange: flat, hierarchical or int8)")
    tp, pp, dp, v, micro, recompute, zero, dp_exchange = m.groups()
    return Candidate(int(tp), int(pp), int(dp), int(micro), v=int(v or 1), recompute=recompute, zero=int(zero),
                     dp_exchange=dp_exchange or "flat")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny on 2 ranks, two layouts")
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--layers", type=int, default=4, help="layers of the model (its width kept)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="sequences a step")
    p.add_argument("--steps", type=int, default=2, help="timed steps a layout a round")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the layouts, the order alternating")
    p.add_argument("--layouts", nargs="+", default=LAYOUTS)
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (consecutive ranks) joined by a slowed link")
    p.add_argument("--inter-gbs", type=float, default=0.1, help="the slowed link's bus bandwidth, GB/s")
    p.add_argument("--inter-latency-ms", type=float, default=1.0, help="the slowed link's hop latency, ms")
    p.add_argument("--timeout", type=float, default=900.0)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = common.parse_with_quick(p, argv, QUICK)
    try:
        layouts = [parse_layout(t) for t in args.layouts]
    except ValueError as e:
        p.error(str(e))
    if min(args.rounds, args.steps) < 1:
        p.error("--rounds and --steps must be >= 1")
    if args.nodes < 1 or args.world % args.nodes or min(args.inter_gbs, args.inter_latency_ms) <= 0:
        p.error(f"--nodes must divide --world ({args.world}); --inter-gbs and --inter-latency-ms must be > 0")
    if any(c.tp * c.pp * c.dp != args.world or args.batch % (c.dp * c.micro) for c in layouts):
        p.error(f"every layout's tp·pp·dp must be --world ({args.world}) and dp·mb divide --batch ({args.batch})")
    return args


def config(args: argparse.Namespace, c: Optional[Candidate] = None) -> Any:
    words = [f"model={args.model}", f"model.n_layers={args.layers}", "model.dropout=0", f"data.seq_len={args.seq}",
             f"train.global_batch_size={args.batch}", "train.eval_every=0", "train.precision=fp32",
             "train.device=cpu", "train.fused_head=off", f"train.steps={10**6}"]
    words += [f"parallel.ranks_per_node={args.world // args.nodes}"] if args.nodes > 1 else []
    cfg = compose_config(words + (c.overrides() if c else []))
    resolve(cfg, VOCAB, "cpu")  # parallel.stage_layers=auto, as hybrid.train resolves it
    return cfg


def one_block(model_cfg: Any) -> Callable[[], torch.nn.Module]:
    """A builder of one of the model's blocks (hidden states in and out): what `calibrate` fits its rates to."""
    cfg = copy.deepcopy(model_cfg)
    cfg.n_layers = 1
    return lambda: build_model(cfg, VOCAB, layers=range(1), pre=False, post=False)


def layout_rank(rank: int, world: int, cfg: Any, steps: int, probe: bool, slow: Optional[SlowLink]
                ) -> dict[str, Any]:
    """Train one untimed and `steps` timed steps; with `probe`, first measure the link inside a node (`plan.probe`);
    with `slow`, over emulated nodes joined by that link."""
    p = cfg.parallel
    if slow is not None:
        install(slow)
    ctx = ParallelContext.build(Layout.create(world, tp=p.tp, pp=p.pp, dp=p.dp, ranks_per_node=p.ranks_per_node))
    node = node_group(world, p.ranks_per_node or world) if probe else None
    out = {"link": link_probe(node, cfg.model.hidden, 2 * cfg.data.seq_len) if probe else None}
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(VOCAB, cfg.data.seq_len, 64),
                      torch.device("cpu"))
    trainer.train_step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return out | {"step_s": statistics.median(times)}


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    layouts = [parse_layout(t) for t in args.layouts]
    base = config(args)
    shape = shape_of(base.model, VOCAB)
    device = calibrate(shape, args.seq * 2, "cpu", args.world, layer=one_block(base.model))
    rounds, probed = measure(args, layouts)
    cluster = _cluster(args, device, probed)
    out(f"link probe: {probed['busbw'] / 1e9:.2f} GB/s; a hop {probed['idle_latency'] * 1e6:.0f} µs idle, "
        f"{probed['latency'] * 1e6:.0f} µs under load")
    predicted = [predict(shape, replace(c, tp_overlap="chunked"), cluster, args.batch, args.seq, act=4).step_s
                 for c in layouts]
    measured = [statistics.median(r[i] for r in rounds) for i in range(len(layouts))]
    result = report(args, layouts, measured, predicted, cluster, out)
    if len(rounds) > 1:  # the measurement's own repeatability: the ceiling of any model's rank correlation
        again = statistics.median(spearman(a, b) for a, b in zip(rounds, rounds[1:]))
        out(f"the measurements repeat round to round to a Spearman of {again:.2f} (median over consecutive rounds)")
        result["repeat_spearman"] = again
    return result


def _slow(args: argparse.Namespace) -> Optional[SlowLink]:
    if args.nodes == 1:
        return None
    return SlowLink(args.world // args.nodes, args.inter_gbs * 1e9, args.inter_latency_ms / 1e3)


def _cluster(args: argparse.Namespace, device: Device, probed: dict[str, float]) -> Cluster:
    """The machine as the planner sees it: --nodes nodes sharing its cores evenly, the link measured here inside a
    node (bus bandwidth, the hop under load) and, between nodes, the slower of it and the emulated link."""
    intra, slow = Link(probed["busbw"], probed["latency"]), _slow(args)
    inter = intra if slow is None else Link(min(intra.busbw, slow.busbw), max(intra.latency, slow.latency))
    shared = replace(device, cores=max(1, device.cores // args.nodes))
    return Cluster(shared, args.world // args.nodes, args.nodes, intra, inter)


def measure(args: argparse.Namespace, layouts: list[Candidate]) -> tuple[list[list[float]], dict[str, float]]:
    """Each round launches every layout once, in alternating order (forward, then backward, …): per round the
    slowest rank's median timed step of each layout, in the layouts' order; and the link measured in the first."""
    rounds, link = [], None
    for k in range(args.rounds):
        order = list(range(len(layouts)))[:: 1 if k % 2 == 0 else -1]
        got = {}
        for i in order:
            ranks = launch(layout_rank, args.world, config(args, layouts[i]), args.steps, link is None,
                           _slow(args), timeout=args.timeout)
            link = link or ranks[0]["link"]
            got[i] = max(g["step_s"] for g in ranks)
        rounds.append([got[i] for i in range(len(layouts))])
    return rounds, link


def report(args: argparse.Namespace, layouts: list[Candidate], measured: list[float], predicted: list[float],
           cluster: Cluster, out: Callable[[str], None]) -> dict[str, Any]:
    out(f"\n## {args.model} ({args.layers} layers), {args.batch} × {args.seq} tokens a step, {args.world} gloo ranks; "
        f"{cluster.describe()}; link measured {cluster.intra.busbw / 1e9:.2f} GB/s, "
        f"{cluster.intra.latency * 1e6:.0f} µs a hop under load"
        + (f"; between the {args.nodes} emulated nodes {cluster.inter.busbw / 1e9:.2f} GB/s, "
           f"{cluster.inter.latency * 1e3:.1f} ms a hop" if args.nodes > 1 else ""))
    rows = [[c.label(), f"{m:.3f}", f"{p:.3f}", f"{p / m:.2f}"] for c, m, p in zip(layouts, measured, predicted)]
    out("\n".join(common.table(["layout", "measured s", "predicted s", "predicted / measured"], rows)))
    rho, error = spearman(measured, predicted), statistics.median(abs(p / m - 1) for m, p in zip(measured, predicted))
    first = measured[predicted.index(min(predicted))] / min(measured)
    out(f"\nSpearman {rho:.2f} (goal ≥ 0.9); median |error| {error:.1%} (goal ≤ 15 %); the predicted fastest "
        f"measures {first:.3f}× the fastest (goal ≤ 1.05)")
    return {"measured": measured, "predicted": predicted, "spearman": rho, "median_error": error, "first": first}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties broken by order: timings do not tie)."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r
    return out


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
