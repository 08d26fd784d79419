"""Which layout? Every tp × pp × dp (micro batch, schedule, recomputation, ZeRO) a cluster can train a model in, ranked
by predicted step time, each with its memory per rank, its step's parts and the command that runs it.

    hybrid-plan model=gpt-1b --cluster dgx-h100 --nodes 2 --batch 256 --seq 2048
    hybrid-plan model=llama-1b model.n_layers=32 model.hidden=4096 --cluster dgx-a100 --nodes 8 --json
    hybrid-plan model=gpt-1b --cluster dgx-h100 --diagnose diagnose.json      # links as hybrid-diagnose measured

Overrides shape the model as `python -m hybrid.train` takes them (`model=…`, `model.hidden=…`). Flags: `--cluster
NAME` (dgx-a100, dgx-a100-40gb, dgx-h100 — the default —, hgx-h200), `--nodes N` (1), `--gpu NAME`, `--per-node N`,
`--intra LINK`, `--inter LINK` (a link name: nvlink3, nvlink4, pcie4, ib-hdr, ib-ndr, eth-100g, or a bus bandwidth
in GB/s) to change the preset, `--diagnose FILE` (a `hybrid-diagnose --json` report: its node size and measured
links), `--calibrate cpu|cuda` (the device measured on this machine: `hybrid/plan/calibrate.py`; on CPU the node's
ranks share its cores and their gloo link is measured under load: `hybrid/plan/probe.py`), `--batch N` (sequences a
step; default train.global_batch_size), `--seq N` (default data.seq_len), `--vocab N` (default model.vocab_size,
else 50257), `--top K` (5), `--lossy` (let the DP exchange send int8 across nodes where that is faster), `--target
T` (a step time `1.5s` or a throughput `200000tok/s`, `5000tok/s/gpu`: the link speed each layout needs to reach it,
and what int8 across nodes does: `hybrid/plan/target.py`), `--json`. How the prediction is made and how far to trust
it: docs/planning.md. Bad input is one `hybrid: error: …` line and exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool
from hybrid.config import ConfigError, compose_config
from hybrid.model import build_model
from hybrid.overrides import App, check
from hybrid.plan import probe, target
from hybrid.plan.calibrate import calibrate
from hybrid.plan.cost import shape_of
from hybrid.plan.hardware import Cluster, PlanError, device, from_diagnose, link, link_of, preset
from hybrid.plan.predict import Prediction, exchange_seconds
from hybrid.plan.search import Job, plan
from hybrid.record.metrics import format_bytes, format_count
from hybrid.validation import validate


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through the tool's error path, not argparse's usage text
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hybrid-plan", add_help=False)
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--nodes", type=int, default=1)
    for flag in ("--gpu", "--intra", "--inter", "--diagnose", "--target"):
        p.add_argument(flag)
    for flag in ("--per-node", "--batch", "--seq", "--vocab"):
        p.add_argument(flag, type=int)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--calibrate", choices=("cpu", "cuda"))
    p.add_argument("--lossy", action="store_true")
    return p


def cluster_of(args: argparse.Namespace, job: Job) -> Cluster:
    c = preset(args.cluster, args.nodes)
    c = _calibrated(c, args, job) if args.calibrate else c
    c = replace(c, device=device(args.gpu)) if args.gpu else c
    if args.per_node is not None:
        if args.per_node < 1:
            raise PlanError(f"--per-node must be >= 1, got {args.per_node}")
        c = replace(c, per_node=args.per_node)
    c = replace(c, intra=link_of(args.intra)) if args.intra else c
    c = replace(c, inter=link_of(args.inter)) if args.inter else c
    return from_diagnose(Path(args.diagnose), c) if args.diagnose else c


def _calibrated(c: Cluster, args: argparse.Namespace, job: Job) -> Cluster:
    """The preset with its device measured here (`plan.calibrate`); on CPU, the ranks of a node share this machine's
    cores, and the link among them is measured here too (`plan.probe`: gloo's bus bandwidth, a hop under load) —
    between nodes gloo's local link — unless --intra/--inter/--diagnose say otherwise."""
    if args.calibrate == "cuda" and not torch.cuda.is_available():
        raise PlanError("--calibrate cuda: no CUDA device here")
    per_node = args.per_node or c.per_node
    block = copy.deepcopy(job.cfg.model)
    block.n_layers = 1
    dev = calibrate(job.shape, min(job.seq, 4096), args.calibrate, per_node,
                    layer=lambda: build_model(block, job.shape.vocab, layers=range(1), pre=False, post=False))
    c = replace(c, device=dev, per_node=per_node)
    if args.calibrate != "cpu":
        return c
    intra = probe.link_of(probe.measure(per_node, job.shape.hidden, min(job.seq, 4096))) if per_node > 1 else None
    return replace(c, intra=intra or link("gloo-local"), inter=link("gloo-local"))


def job_of(overrides: list[str], args: argparse.Namespace) -> Job:
    check(overrides, App("hybrid.train", None))
    cfg = compose_config(overrides)
    batch = args.batch if args.batch is not None else cfg.train.global_batch_size
    seq = args.seq if args.seq is not None else cfg.data.seq_len
    vocab = args.vocab if args.vocab is not None else (cfg.model.vocab_size or 50257)
    if min(batch, seq, vocab, args.top) < 1:
        raise PlanError(f"--batch, --seq, --vocab and --top must be >= 1, got {batch}, {seq}, {vocab}, {args.top}")
    return Job(cfg, shape_of(cfg.model, vocab), batch, seq)


def table(plans: list[Prediction]) -> list[str]:
    head = (f"{'#':>2} {'layout':<38} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'mem/rank':>10} {'compute':>8} "
            f"{'tp exp':>7} {'bubble':>7} {'dp exp':>7} {'optim':>7}")
    rows = [f"{i:>2} {p.candidate.label():<38} {p.step_s:>8.3f} {p.tokens_per_s_per_gpu:>10.0f} {p.mfu:>6.1%} "
            f"{format_bytes(p.memory):>10} " + " ".join(f"{p.parts[k]:>{w}.3f}" for k, w in (
                ("compute", 8), ("tp_exposed", 7), ("bubble", 7), ("dp_exposed", 7), ("optimizer", 7)))
            for i, p in enumerate(plans, 1)]
    return [head, *rows]


def exchange_line(best: Prediction, job: Job, cluster: Cluster) -> list[str]:
    """The first plan's DP exchange against the others its links allow (seconds a step, before overlap)."""
    timed = exchange_seconds(best.candidate, job.shape, cluster)
    if len(timed) < 2:
        return []
    chosen = best.candidate.dp_exchange
    others = ", ".join(f"{m} {s:.3f} s" for m, s in timed.items() if m != chosen)
    lossy = "; int8 is lossy: --lossy lets the plan pick it" if "int8" in timed and chosen != "int8" else ""
    return [f"DP exchange of the first: {chosen} {timed[chosen]:.3f} s a step (else {others}){lossy}"]


def command(job: Job, cluster: Cluster, best: Prediction, overrides: list[str]) -> str:
    words = [*overrides, *best.candidate.overrides(), f"train.global_batch_size={job.global_batch}",
             f"data.seq_len={job.seq}", "train.precision=bf16_params"]
    nodes = f"--nnodes {cluster.nodes} " if cluster.nodes > 1 else ""
    return f"torchrun {nodes}--nproc_per_node {cluster.per_node} -m hybrid.train {' '.join(words)}"


def body(argv: list[str]) -> str:
    args, rest = parser().parse_known_args(argv)
    bad = [w for w in rest if w.startswith("-")]
    if bad:
        raise UsageError(f"unknown flag {bad[0]}; the rest of the command line is model overrides")
    job = job_of(rest, args)
    cluster = cluster_of(args, job)
    from hybrid.trainer import build_chunks

    tokens = job.global_batch * job.seq
    goal = target.parse(args.target, tokens, cluster.world) if args.target else None
    plans, tried = plan(job, cluster, lambda cfg: lambda ctx: build_chunks(cfg, job.shape.vocab, ctx), args.top,
                        check=validate, lossy=args.lossy)
    answers = [target.answer(job.shape, p, cluster, job.global_batch, job.seq, goal) for p in plans] if goal else []
    if args.json:
        return json.dumps({"cluster": cluster.describe(), "model": job.cfg.model.name, "batch": job.global_batch,
                           "seq": job.seq, "layouts_considered": tried,
                           "plans": [p.to_json() | {"dp_exchanges_s": exchange_seconds(p.candidate, job.shape, cluster)}
                                     for p in plans],
                           "command": command(job, cluster, plans[0], rest)}
                          | ({"target": {"text": goal.text, "step_s": goal.step_s,
                                         "layouts": [a.to_json() for a in answers]}} if goal else {}), indent=1)
    params = job.shape.layers * job.shape.layer_params() + job.shape.vocab * job.shape.hidden
    lines = [f"plan: {job.cfg.model.name} ({format_count(params)} parameters), {job.global_batch} × {job.seq} tokens a "
             f"step on {cluster.describe()}", f"{tried} layouts considered; the fastest that fit:", *table(plans),
             *exchange_line(plans[0], job, cluster), *(target.lines(goal, answers, tokens) if goal else []),
             f"run the first: {command(job, cluster, plans[0], rest)}"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    return run_tool(__doc__, argv, body, ((UsageError, EXIT_BAD_INPUT), (ConfigError, EXIT_BAD_INPUT),
                                          (PlanError, EXIT_BAD_INPUT)))


if __name__ == "__main__":
    sys.exit(main())
