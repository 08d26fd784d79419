"""Pipeline parallelism on gloo CPU ranks: measured bubble vs the simulator, our 1F1B vs torch's, PP bytes, headline.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.pp [--sections bubble,torch,bytes,headline]

- bubble: pp=2 on 2 forked ranks; gpipe, 1f1b and interleaved (v=2) through `run_schedule` for every --microbatches.
  Per rank: bubble = 1 − compute (`PipelineStats`) / step time (the slowest rank's, from a common barrier), median
  of --steps; beside it `simulate()` at the measured f, b (mean of the ranks, and the slower rank's) and the
  unit-cost (p−1)/(v·m+p−1).
- torch: our 1F1B vs `torch.distributed.pipelining.Schedule1F1B` on the same stage modules (untied, loss = mean CE
  per microbatch / m on both sides, forward+backward only), alternated step by step: median s/step, median
  per-pair ratio ours/torch, and the gradients' max difference.
- bytes: one `Trainer.train_step` per layout (pp2, pp4, tp2pp2 ± SP; 1f1b and interleaved v=2): `COUNTER` bytes
  of group "pp" on every rank vs `pp_bytes_per_step`.
- headline (only when named): `torchrun --nproc_per_node 8 -m hybrid.train model=gpt-1b parallel=tp2pp4`, one
  short step: wall time, the logged step, peak RSS (VmHWM) per rank vs parameters per rank × 16 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import check_models, split_sections
from hybrid.bench.ranks import launch
from hybrid.bench.tp import synthetic_corpus
from hybrid.compression.hooks import make_hook
from hybrid.config import compose_config, validate
from hybrid.model import build_model
from hybrid.model.traffic import pp_bytes_per_step
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.pipeline import P2P, PipelineStats, partition_layers, run_schedule
from hybrid.parallel.schedules import SCHEDULES, build_schedule, simulate
from hybrid.parallel.tensor import vocab_parallel_cross_entropy
from hybrid.trainer import Trainer, build_chunks

SECTIONS = ("bubble", "torch", "bytes", "headline")
DEFAULT_SECTIONS = ("bubble", "torch", "bytes")
BUBBLE_SCHEDULES = tuple((name, s.min_virtual_stages) for name, s in SCHEDULES.items())  # (name, v): every schedule
BYTES_LAYOUTS = ((1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True))  # (tp, pp, sequence parallel)
CPU = torch.device("cpu")
GB = 2**30


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.pp", description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help="comma-separated subset of "
                   + ",".join(SECTIONS) + " (headline only when named)")
    p.add_argument("--model", default="gpt-tiny", help="configs/model of bubble, torch and bytes")
    p.add_argument("--layers", type=int, default=4, help="model.n_layers of bubble and torch (pp·v = 4 parts)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (small: keeps the head cheaper than a layer)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="m of the bubble section")
    p.add_argument("--torch-microbatches", type=int, default=8, help="m of the torch section")
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    p.add_argument("--torch-steps", type=int, default=12, help="timed steps per contender of the torch section")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    p.add_argument("--bytes-layers", type=int, default=8, help="model.n_layers of bytes (pp4 × v2 = 8 parts)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")
    p.add_argument("--headline-timeout", type=float, default=900.0, help="seconds before torchrun is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults (bubble, torch, bytes) take about a minute on 2 idle cores."""
    p = build_parser()
    args = p.parse_args(argv)
    split_sections(p, args, SECTIONS)
    check_models(p, args.model)
    sizes = (args.seq, args.micro_batch, args.steps, args.torch_steps, *args.microbatches)
    if min(sizes) < 1 or args.layers < 4 or args.bytes_layers < 8 or args.torch_microbatches < 2 \
            or any(m % 2 for m in args.microbatches + [args.seq]):
        p.error("sizes must be >= 1, --layers >= 4 and --bytes-layers >= 8 (pp·v parts), --torch-microbatches >= pp=2, "
                "--microbatches and --seq even (interleaved, SP)")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command("hybrid.bench.pp", build_parser(), args)


def bench_cfg(args: argparse.Namespace, *overrides: str) -> Any:
    """The composed config of the in-process sections (fp32 on CPU, no eval), plus `overrides`."""
    return compose_config([f"model={args.model}", f"model.vocab_size={args.vocab}", f"data.seq_len={args.seq}",
                           f"train.micro_batch_size={args.micro_batch}", "train.eval_every=0",
                           "train.precision=fp32", "train.device=cpu", *overrides])


def pp_context(cfg: Any, world: int) -> ParallelContext:
    """The mesh `cfg.parallel` asks for on `world` ranks, its groups named for COUNTER."""
    ctx = ParallelContext.build(validate(cfg, world, world))
    for name in ("tp", "dp", "pp", "embedding"):
        C.name_group(getattr(ctx, f"{name}_group"), name)
    return ctx


def microbatches(vocab: int, m: int, b: int, s: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`m` (ids, labels) pairs of [b, s] uniform random tokens (labels = ids shifted by one)."""
    ids = torch.randint(0, vocab, (m, b, s + 1), generator=torch.Generator().manual_seed(seed))
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def forward_step(chunks: torch.nn.ModuleList, mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """The executor's forward step: ids into the first part, hidden states between, the mean loss out."""
    def step(chunk: int, mb: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        module = chunks[chunk]
        ids, labels = mbs[mb]
        return module(ids if module.pre else x, labels if module.post else None)
    return step


# ---- bubble ----------------------------------------------------------------------------------------------------

def analytic_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle share of a step at unit costs: (p−1)/(v·m+p−1)."""
    return (pp - 1) / (v * m + pp - 1)


def measured_bubble(walls: list[list[float]], busy: list[list[float]]) -> list[float]:
    """Per rank: the median over steps of 1 − busy / step time, the step time being the slowest rank's."""
    steps = [max(w) for w in zip(*walls)]
    return [statistics.median(1 - b / t for b, t in zip(rank_busy, steps)) for rank_busy in busy]


def bubble_cfgs(args: argparse.Namespace) -> list[Any]:
    """The config of each BUBBLE_SCHEDULES entry (composed once in the parent: Hydra is slow on busy cores)."""
    gbs = args.micro_batch * args.microbatches[0]
    return [bench_cfg(args, f"model.n_layers={args.layers}", "parallel.pp=2", f"parallel.schedule={name}",
                      f"parallel.virtual_stages={v}", f"train.global_batch_size={gbs}") for name, v in BUBBLE_SCHEDULES]


def bubble_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any]) -> dict[tuple[str, int], dict]:
    """Per (schedule, m): this rank's step walls, busy seconds, forward and backward seconds per microbatch."""
    out = {}
    for (name, v), cfg in zip(BUBBLE_SCHEDULES, cfgs):
        ctx = pp_context(cfg, world)
        chunks = build_chunks(cfg, args.vocab, ctx)
        p2p = P2P(ctx.pp_group, (args.micro_batch, args.seq, cfg.model.hidden), torch.float32, CPU)
        for m in args.microbatches:
            schedule, step = build_schedule(name, world, m, v), forward_step(chunks, microbatches(args.vocab, m,
                                                                             args.micro_batch, args.seq))
            walls, stats = [], []
            for i in range(args.warmup + args.steps):
                chunks.zero_grad(set_to_none=True)
                st = PipelineStats()
                dist.barrier()
                start = time.perf_counter()
                run_schedule(schedule, ctx.pp_rank, step, p2p, st)
                if i >= args.warmup:
                    walls.append(time.perf_counter() - start)
                    stats.append(st)
            out[(name, m)] = {"walls": walls, "busy": [s.busy_s for s in stats],
                              "forward": statistics.mean(f for s in stats for f in s.forward_s) * v,
                              "backward": statistics.mean(b for s in stats for b in s.backward_s) * v}
    return out


def bottleneck_bubble(name: str, pp: int, m: int, v: int, forward: list[float], backward: list[float]) -> list[float]:
    """Per rank: 1 − m·(f_r + b_r) / makespan, the makespan simulated at the slowest rank's f, b (which paces
    every stage), the rank's busy time its own measured m·(f_r + b_r)."""
    f, b = max(forward), max(backward)
    makespan = simulate(build_schedule(name, pp, m, v), forward=f, backward=b).makespan
    return [1 - m * (fr + br) / makespan for fr, br in zip(forward, backward)]


def section_bubble(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Measured bubble per rank vs the simulator at the measured costs vs the unit-cost analytic."""
    res = launch(bubble_rank, 2, args, bubble_cfgs(args), timeout=args.timeout)
    out(f"\n## bubble: pp=2 on 2 ranks, {args.model} cut to {args.layers} layers (pp·v parts), vocab {args.vocab}, "
        f"micro batch {args.micro_batch} × {args.seq} tokens, fp32, median of {args.steps} steps after {args.warmup}")
    out("schedule        |  m | f ms r0/r1 | b ms r0/r1 | measured r0/r1 | simulated mean f,b | simulated slowest "
        "r0/r1 | analytic")
    out("----------------|----|------------|------------|----------------|--------------------|------------------"
        "------|---------")
    rows = []
    for name, v in BUBBLE_SCHEDULES:
        for m in args.microbatches:
            per = [r[(name, m)] for r in res]
            fs, bs = [p["forward"] for p in per], [p["backward"] for p in per]
            sim = simulate(build_schedule(name, 2, m, v), forward=statistics.mean(fs), backward=statistics.mean(bs))
            row = {"schedule": name, "v": v, "m": m, "simulated": sim.bubble, "analytic": analytic_bubble(2, m, v),
                   "measured": measured_bubble([p["walls"] for p in per], [p["busy"] for p in per]),
                   "slowest": bottleneck_bubble(name, 2, m, v, fs, bs)}
            rows.append(row)
            label = name + (f" v={v}" if v > 1 else "")
            out(f"{label:15s} | {m:2d} | {fs[0] * 1e3:4.0f}/{fs[1] * 1e3:<5.0f} | "
                f"{bs[0] * 1e3:4.0f}/{bs[1] * 1e3:<5.0f} | "
                f"{row['measured'][0]:.3f}/{row['measured'][1]:.3f}    | {row['simulated']:18.3f} | "
                f"{row['slowest'][0]:.3f}/{row['slowest'][1]:.3f}             | {row['analytic']:.3f}")
    out("bubble = 1 − compute / step time; a step's time is the slowest rank's, from a common barrier. f, b: mean "
        "measured seconds of one microbatch through a rank's whole stage (a chunk's × v). 'simulated mean f,b' runs "
        "simulate() at the mean over both ranks (it models equal stages); 'simulated slowest' at the slower rank's "
        "f, b, each rank busy for its own m·(f+b): the last stage's head and loss outweigh the first's embedding. "
        "On 2 shared CPU cores gloo's p2p copies over local TCP, the send/recv rendezvous waits and the OS "
        "scheduler add idle time the simulator does not model: expect measured ≳ simulated, up to timing noise.")
    return rows


# ---- torch -----------------------------------------------------------------------------------------------------

def torch_rank(rank: int, world: int, args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """Alternate our 1F1B and torch's Schedule1F1B on the same stage; seconds per step and the grads' max diff."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    m, b, s = args.torch_microbatches, args.micro_batch, args.seq
    ctx = pp_context(cfg, world)
    module = build_chunks(cfg, args.vocab, ctx)
    mbs = microbatches(args.vocab, m, b, s)
    ours_step, schedule = forward_step(module, mbs), build_schedule("1f1b", world, m)
    p2p = P2P(ctx.pp_group, (b, s, cfg.model.hidden), torch.float32, CPU)
    stage = PipelineStage(module[0], ctx.pp_rank, world, CPU, group=ctx.pp_group)
    pipe = Schedule1F1B(stage, m, loss_fn=lambda y, t: vocab_parallel_cross_entropy(y, t, None, args.vocab) / m,
                        scale_grads=False)
    ids, labels = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
    contenders = {
        "ours": lambda: run_schedule(schedule, ctx.pp_rank, ours_step, p2p),
        "torch": lambda: pipe.step(*([ids] if module[0].pre else []), target=labels if module[0].post else None,
                                   return_outputs=False)}
    grads = {}
    for name, fn in contenders.items():
        module.zero_grad(set_to_none=True)
        fn()
        grads[name] = [p.grad.clone() for p in module.parameters()]
    diff = max(float((a - c).abs().max()) for a, c in zip(grads["ours"], grads["torch"]))
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(args.warmup + args.torch_steps):
        for name in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            module.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            contenders[name]()
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "grad_diff": diff}


def section_torch(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Seconds per forward+backward step of our 1F1B vs torch's, side by side; ratio ours/torch (goal ≤ 1)."""
    cfg = bench_cfg(args, f"model.n_layers={args.layers}", "parallel.pp=2", "model.tie_embeddings=false",
                    f"train.global_batch_size={args.micro_batch * args.torch_microbatches}")
    res = launch(torch_rank, 2, args, cfg, timeout=args.timeout)
    t, diff = res[0]["times"], max(r["grad_diff"] for r in res)
    ratios = [a / c for a, c in zip(t["ours"], t["torch"])]
    row = {"ours": statistics.median(t["ours"]), "torch": statistics.median(t["torch"]),
           "ratio": statistics.median(ratios), "grad_diff": diff}
    out(f"\n## torch: 1F1B, pp=2 on 2 ranks, {args.model} cut to {args.layers} layers, untied, vocab {args.vocab}, "
        f"m={args.torch_microbatches} × {args.micro_batch} × {args.seq} tokens, forward+backward only, ours/torch "
        f"alternated, {args.torch_steps} timed steps each after {args.warmup}")
    out("contender                              | median s/step | min..max")
    out("---------------------------------------|---------------|-------------")
    for name, label in (("ours", "hybrid run_schedule(1f1b)"), ("torch", "torch.distributed.pipelining 1F1B")):
        out(f"{label:38s} | {row[name]:13.3f} | {min(t[name]):.3f}..{max(t[name]):.3f}")
    out(f"ratio ours/torch (median of per-step pairs): {row['ratio']:.3f} (goal ≤ 1.0; pairs "
        f"{min(ratios):.3f}..{max(ratios):.3f})")
    out(f"sanity: gradients of one step, ours vs torch, max |diff| over both stages = {diff:.3g}")
    return row


# ---- bytes -----------------------------------------------------------------------------------------------------

def bytes_cfgs(args: argparse.Namespace, world: int, gbs: int) -> list[Any]:
    """The configs of every BYTES_LAYOUTS entry on `world` ranks × (1f1b, interleaved v=2)."""
    return [bench_cfg(args, f"model.n_layers={args.bytes_layers}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                      f"parallel.schedule={name}", f"parallel.virtual_stages={v}", "train.steps=1",
                      f"parallel.sequence_parallel={str(sp).lower()}", f"train.global_batch_size={gbs}")
            for tp, pp, sp in BYTES_LAYOUTS if tp * pp == world for name, v in (("1f1b", 1), ("interleaved", 2))]


def bytes_rank(rank: int, world: int, args: argparse.Namespace, cfgs: list[Any], gbs: int) -> list[dict[str, Any]]:
    """COUNTER's "pp" bytes of one Trainer.train_step for every config."""
    rows = []
    corpus = synthetic_corpus(args.vocab, args.seq, 4 * gbs)
    for cfg in cfgs:
        p = cfg.parallel
        ctx = pp_context(cfg, world)
        hook, state = make_hook(cfg.compression, ctx.dp_group)
        trainer = Trainer(cfg, ctx, build_chunks(cfg, args.vocab, ctx), corpus, CPU, hook, state)
        C.COUNTER.reset()
        trainer.train_step()
        counted = {op: n for (g, op), n in C.COUNTER.bytes.items() if g == "pp"}
        analytic = pp_bytes_per_step(args.micro_batch, args.seq, cfg.model.hidden, p.tp, p.sequence_parallel,
                                     trainer.num_microbatches, p.pp, p.virtual_stages, ctx.pp_rank)
        rows.append({"tp": p.tp, "pp": p.pp, "sp": p.sequence_parallel, "schedule": p.schedule,
                     "v": p.virtual_stages, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
                     "m": trainer.num_microbatches, "counted": counted, "analytic": analytic,
                     "equal": counted == analytic})
    return rows


def section_bytes(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Counted vs analytic PP bytes per step on every rank of pp2, pp4, tp2pp2 and tp2pp2+SP."""
    import torch._dynamo  # noqa: F401  (AdamW imports it lazily: once here, not in every forked rank)

    gbs, rows, h = 4 * args.micro_batch, [], bench_cfg(args).model.hidden
    for world in sorted({tp * pp for tp, pp, _ in BYTES_LAYOUTS}):
        rows += [r for rank_rows in launch(bytes_rank, world, args, bytes_cfgs(args, world, gbs),
                                           gbs, timeout=args.timeout) for r in rank_rows]
    rows.sort(key=lambda r: (BYTES_LAYOUTS.index((r["tp"], r["pp"], r["sp"])), r["v"], r["pp_rank"], r["tp_rank"]))
    out(f"\n## bytes_pp per step: {args.model} with {args.bytes_layers} layers, m = 4 microbatches × "
        f"{args.micro_batch} × {args.seq} tokens, dp=1 (COUNTER payload of group 'pp' vs traffic.pp_bytes_per_step)")
    out("layout     | schedule        | pp rank | send_fwd  | send_bwd  | all_reduce | counted   | analytic  | equal "
        "| per boundary per mb per direction")
    out("-----------|-----------------|---------|-----------|-----------|------------|-----------|-----------|-------"
        "|----------------------------------")
    for r in rows:
        if r["tp_rank"]:
            continue  # TP ranks of a stage send the same (checked in `equal` for all)
        c, a = r["counted"], r["analytic"]
        layout = (f"tp{r['tp']}" if r["tp"] > 1 else "") + f"pp{r['pp']}" + ("+SP" if r["sp"] else "")
        seq = args.seq // r["tp"] if r["sp"] else args.seq
        label = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        out(f"{layout:10s} | {label:15s} | {r['pp_rank']:7d} | {c.get('send_fwd', 0):9d} | {c.get('send_bwd', 0):9d} "
            f"| {c.get('all_reduce', 0):10d} | {sum(c.values()):9d} | {sum(a.values()):9d} | {str(r['equal']):5s} | "
            f"b·{'s/t' if r['sp'] else 's'}·h·4 = {args.micro_batch}·{seq}·{h}·4 = "
            f"{args.micro_batch * seq * h * 4}")
    out(f"all {len(rows)} rank rows (every TP rank included) equal: {all(r['equal'] for r in rows)}; all_reduce is "
        "the grad norm's fp32 scalar over PP; the tied embedding's gradient goes over the 'embedding' group.")
    return rows


# ---- headline --------------------------------------------------------------------------------------------------

HEADLINE = ["model=gpt-1b", "parallel=tp2pp4", "data.seq_len=64", "train.micro_batch_size=1",
            "train.global_batch_size=4", "train.steps=1", "train.eval_every=0", "logging.progress=false",
            "logging.wandb.mode=disabled"]


def headline_command(log_dir: str) -> list[str]:
    """The issue's headline command for one short step (torchrun --standalone: a free rendezvous port)."""
    return ["torchrun", "--standalone", "--nproc_per_node", "8", "-m", "hybrid.train", *HEADLINE,
            f"logging.dir={log_dir}"]


HEADLINE_NEEDS_GIB = 18


def proc_status_kb(status: str, key: str) -> int:
    """The kB figure of `key` (VmHWM, VmRSS) in a /proc/<pid>/status text; 0 when absent."""
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def sample_peaks(pid: int, stop: threading.Event, peaks: dict[str, int], period: float = 0.5,
                 on_low_memory: Optional[Callable[[], None]] = None, low_kb: int = 2**20) -> None:
    """Until `stop`: peaks[RANK of each descendant] = max VmHWM kB, peaks["total"] = max sum of their VmRSS kB,
    peaks["min_available"] = least MemAvailable kB; calls `on_low_memory` once MemAvailable < `low_kb`."""
    while not stop.wait(period):
        total = 0
        for child in descendants(pid):
            try:
                status = Path(f"/proc/{child}/status").read_text()
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
            total += proc_status_kb(status, "VmRSS")
            if rank is not None:
                peaks[rank] = max(peaks.get(rank, 0), proc_status_kb(status, "VmHWM"))
        peaks["total"] = max(peaks.get("total", 0), total)
        available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable")
        peaks["min_available"] = min(peaks.get("min_available", available), available)
        if on_low_memory is not None and available < low_kb:
            on_low_memory()
            on_low_memory = None


def stage_params_rank(rank: int, world: int, cfg: Any, vocab: int) -> list[int]:
    """Parameters of TP rank `rank`'s shard of every pipeline stage of `cfg` (built on the meta device)."""
    pp = cfg.parallel.pp
    group = ParallelContext.build(Layout.create(world, tp=world)).tp_group
    parts = partition_layers(cfg.model.n_layers, pp, cfg.parallel.stage_layers)
    with torch.device("meta"):
        return [sum(p.numel() for p in build_model(cfg.model, vocab, group, layers=parts[s], pre=s == 0,
                                                    post=s == pp - 1).parameters()) for s in range(pp)]


def run_headline(cmd: list[str], timeout: float) -> tuple[int, str, float, dict[str, int]]:
    """Run `cmd` in its own process group while sampling memory; (exit status, output, wall s, peaks)."""
    peaks: dict[str, int] = {}
    stop = threading.Event()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: the guards kill it whole
    sampler = threading.Thread(target=sample_peaks, daemon=True, args=(proc.pid, stop, peaks, 0.5,
                               lambda: os.killpg(proc.pid, signal.SIGKILL)))
    sampler.start()
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + "\n(killed: timeout)"
    stop.set()
    sampler.join()
    return proc.returncode, log, time.perf_counter() - start, peaks


def section_headline(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """Run the headline command once; wall time, the logged step, peak RSS per rank vs params × 16 bytes."""
    cfg = compose_config(HEADLINE)
    tp = cfg.parallel.tp
    params = launch(stage_params_rank, tp, cfg, cfg.model.vocab_size, timeout=args.timeout)[0]
    log_dir = tempfile.mkdtemp(prefix="hybrid-bench-pp-")
    cmd = headline_command(log_dir)
    out(f"\n## headline: {' '.join(cmd)}  (OMP_NUM_THREADS=1)")
    available = proc_status_kb(Path("/proc/meminfo").read_text(), "MemAvailable") / 2**20
    if available < HEADLINE_NEEDS_GIB:
        out(f"not run: {available:.1f} GiB available, it needs about {HEADLINE_NEEDS_GIB} GiB")
        return {"returncode": None, "available_gib": available, "params": params}
    code, log, wall, peaks = run_headline(cmd, args.headline_timeout)
    metrics = Path(log_dir, "metrics.jsonl")
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    step = next((s for s in steps if "loss" in s), {})
    out(f"exit {code}, wall {wall:.1f} s (start-up, data, build and 1 step), run dir {log_dir}")
    for key in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "bytes_tp", "bytes_pp", "bytes_dp",
                "bytes_embedding"):
        out(f"  {key:16s} {step.get(key, 'missing')}")
    out("stage | params per rank (tp shard) | × 16 B (fp32 param+grad+2 AdamW moments) | peak VmHWM of its ranks")
    for s, n in enumerate(params):
        hwm = [peaks.get(str(r), 0) / 2**20 for r in range(s * tp, (s + 1) * tp)]
        out(f"{s:5d} | {n:26,d} | {n * 16 / GB:37.2f} GiB | {' / '.join(f'{h:.2f}' for h in hwm)} GiB")
    out(f"peak sum of RSS over all ranks {peaks.get('total', 0) / 2**20:.2f} GiB; expected ≈ Σ params × 16 B "
        f"= {sum(params) * tp * 16 / GB:.2f} GiB plus ~0.3–0.5 GiB of torch/python per rank, activations and "
        f"AdamW's foreach temporaries; least MemAvailable {peaks.get('min_available', 0) / 2**20:.2f} GiB "
        "(the run is killed below 1 GiB, to spare the machine's other processes)")
    if code:
        out("last output:\n" + log[-3000:])
    return {"returncode": code, "wall": wall, "step": step, "peaks": peaks, "params": params}


# ---- driver ----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections in order; returns their rows (for tests)."""
    sections = (("bubble", section_bubble), ("torch", section_torch), ("bytes", section_bytes),
                     ("headline", section_headline))
    return common.run_sections(sections, args, reproduce_command(args), "hybrid.bench.pp", out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when a counted PP byte figure differs from the analytic one or the headline run failed
    (a headline not run for lack of memory is reported, not failed)."""
    result = run(parse_args(argv))
    ok = all(r["equal"] for r in result.get("bytes", []))
    return 0 if ok and result.get("headline", {}).get("returncode") in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
