"""hybrid's ZeRO stages and ZeRO++ beside torch's FSDP2 (`fully_shard`, and its HSDP) on the same model, ranks and
batches, on emulated nodes: step time and peak memory.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.zero_vs_fsdp2 [--dp 4] [--node 2] [--model gpt-125m]
        [--seq 256] [--rounds 3] [--steps 3] [--sides zero3 fsdp2 ...] [--quick]

Each round launches, in alternating order (A B …, … B A), --dp gloo ranks once per side
(`parallel.ranks_per_node=--node`): hybrid's Trainer under ZeRO-1, 2, 3, 3 + hpZ, 3 + qwZ + qgZ, ZeRO++ (all three)
and HSDP (`zero_group=node`), and the same model (`build_chunks`, tp = pp = 1) with `fully_shard` on every
transformer block and on the whole chunk (FSDP2's per-block units and root, `reshard_after_forward=True`) over the
DP ranks, or over a 2-D (replicate, shard) mesh whose shard dimension is a node (FSDP2's HSDP); AdamW (foreach: the
fused CPU kernel takes no DTensor) over hybrid's decay groups, `clip_grad_norm_` at `optim.grad_clip`, the same LR
schedule and the same samples per rank (`StepSampler`). Reported per side, medians over rounds: the step time, its
ratio to ZeRO-3's in the same round, each rank's peak resident set over its timed steps less its resident set
before them (VmHWM after clearing), and the losses of the first steps (FSDP2 and ZeRO-3 train alike:
`tests/dist/test_zero.py` holds them to 1e-5). One machine emulates the nodes: its "inter-node" links are as fast as
the others, so the step times show what each side's compute and codecs cost, not what it saves on a slow link
(its bytes: `hybrid.bench.zero_plus_plus`).

FSDP2 does not run where hybrid needs its own ZeRO: its DTensor parameters lose hybrid's parameter records (the
checkpoint, export, norm and TP gradient sums read them), its gradients are DTensors that hybrid's fragment norm
cannot read, bf16 main gradients cannot be views, the zero-bubble schedules' split backward fails on its freed
parameters, and it has no hook for a codec's compressed all-gather or a second in-node partition (hpZ).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import launch
from hybrid.bench.memory import rss_mib
from hybrid.bench.zero_common import VOCAB, add_shape, corpus, parse, shape_label
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.optim import lr_at, param_groups
from hybrid.optim.adamw import adamw_over
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.sampler import StepSampler, batch_from
from hybrid.trainer import Trainer, build_chunks

MODULE = "hybrid.bench.zero_vs_fsdp2"
QUICK = {"model": "gpt-tiny", "dp": 4, "seq": 64, "rounds": 1, "steps": 2, "timeout": 120.0, "layers": 1}
CODECS = ("parallel.zero_param_codec=int8", "compression=int4")
SIDES: dict[str, tuple[str, ...]] = {  # hybrid's sides: their overrides; FSDP2's: none
    "zero1": ("parallel.zero=1",), "zero2": ("parallel.zero=2",), "zero3": (),
    "zero3+hpZ": ("parallel.zero_hpz=true",), "zero3+qwZ+qgZ": CODECS,
    "ZeRO++": ("parallel.zero_hpz=true", *CODECS), "HSDP": ("parallel.zero_group=node",),
    "fsdp2": (), "fsdp2 HSDP": (),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny at dp2, 64 tokens, one round of two steps, seconds")
    add_shape(p, steps=3)
    p.add_argument("--node", type=int, default=2, help="parallel.ranks_per_node: DP ranks per emulated node")
    p.add_argument("--sides", nargs="+", default=list(SIDES), help=f"a subset of: {', '.join(SIDES)}")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse(p, argv, QUICK)
    if any(x not in SIDES for x in args.sides) or "zero3" not in args.sides:
        p.error(f"--sides must be a subset of {', '.join(SIDES)} holding zero3 (the ratios' base)")
    if args.dp % args.node or not 1 < args.node < args.dp:
        p.error("--node must divide --dp, with 2 nodes at least and 2 ranks at least on each")
    return args


def config(model: str, layers: int, dp: int, seq: int, batch: int, steps: int, *extra: str) -> Any:
    """ZeRO-3 over `dp` ranks (unless `extra` says otherwise), fp32, no dropout, one microbatch of `batch` sequences
    per rank and step."""
    cut = [f"model.n_layers={layers}"] if layers else []
    return compose_config([f"model={model}", *cut, "model.dropout=0", f"data.seq_len={seq}",
                           f"train.micro_batch_size={batch}", f"train.global_batch_size={batch * dp}",
                           "train.eval_every=0", f"train.steps={steps}", f"parallel.dp={dp}", "parallel.zero=3",
                           "train.fused_head=off", "optim.implementation=foreach", "train.precision=fp32", *extra])


def zero3_steps(cfg: Any, ctx: ParallelContext, data: Corpus, steps: int) -> list[Callable[[], float]]:
    """hybrid's Trainer under ZeRO-3: one callable per step, returning the step's DP-mean loss."""
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), data, torch.device("cpu"))
    return [lambda: trainer.train_step().loss for _ in range(steps)]


def fsdp2_steps(cfg: Any, ctx: ParallelContext, data: Corpus, steps: int, node: int = 0
                ) -> list[Callable[[], float]]:
    """The same model under `fully_shard` (blocks, then the chunk) and the same optimizer, schedule and samples;
    with `node`, HSDP: sharded over each node's `node` ranks, replicated across (tp = pp = 1: DP is the world)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    chunk = build_chunks(cfg, VOCAB, ctx)[0]
    mesh = (init_device_mesh("cpu", (ctx.dp_size // node, node), mesh_dim_names=("replicate", "shard")) if node
            else DeviceMesh.from_group(ctx.dp_group, "cpu"))
    for block in chunk.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(chunk, mesh=mesh)
    t, o = cfg.train, cfg.optim
    opt = adamw_over(param_groups(chunk, o.weight_decay), o, t.lr)
    sampler = StepSampler(len(data.train), t.micro_batch_size, 1, ctx.dp_size, ctx.dp_rank, t.seed)

    def step(n: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(n, t.lr, t.steps, o.warmup_steps, o.min_lr_ratio)
        ids, labels = batch_from(data.train, sampler.next_step()[0])
        loss = chunk(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(chunk.parameters()), o.grad_clip)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ctx.dp_group)
        return float(mean) / ctx.dp_size

    return [lambda n=n: step(n) for n in range(steps)]


def side_rank(rank: int, world: int, cfg: Any, steps: int, side: str) -> dict[str, Any]:
    """One untimed step, then `steps` timed ones: their losses, the mean step time, the peak RSS over them."""
    import time

    from hybrid.bench.memory_at_scale import reset_peak

    node = cfg.parallel.ranks_per_node
    ctx = ParallelContext.build(Layout.create(world, ranks_per_node=node))
    data = corpus(cfg.data.seq_len)
    if side.startswith("fsdp2"):
        run = fsdp2_steps(cfg, ctx, data, steps + 1, node if side == "fsdp2 HSDP" else 0)
    else:
        run = zero3_steps(cfg, ctx, data, steps + 1)
    losses = [run[0]()]
    base, cleared = rss_mib(), reset_peak()
    start = time.perf_counter()
    losses += [f() for f in run[1:]]
    return {"losses": losses, "step_s": (time.perf_counter() - start) / steps,
            "peak_mib": rss_mib("VmHWM") - base if cleared else float("nan")}


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    got: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
    for i in range(args.rounds):
        for side in args.sides if i % 2 == 0 else args.sides[::-1]:
            cfg = config(args.model, args.layers, args.dp, args.seq, args.batch, args.steps + 1,
                         f"parallel.ranks_per_node={args.node}", *SIDES[side])
            got[side].append(launch(side_rank, args.dp, cfg, args.steps, side, timeout=args.timeout)[0])
    out(f"\n## {shape_label(args)}, nodes of {args.node}; medians over {args.rounds} rounds × {args.steps} steps "
        "(rank 0)")
    rows = [[side, f"{statistics.median(r['step_s'] for r in got[side]):.3f}",
             f"{statistics.median(a['step_s'] / b['step_s'] for a, b in zip(got[side], got['zero3'])):.2f}",
             f"{statistics.median(r['peak_mib'] for r in got[side]):.0f}",
             " ".join(f"{x:.5f}" for x in got[side][0]["losses"][:3])] for side in args.sides]
    out("\n".join(common.table(["side", "step s", "÷ zero3 (same round)", "peak over base MiB", "first losses"], rows)))
    return got


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())

