"""How well the block codecs fit each kind of weight's gradient, laid out by rows or by columns, along an exact run.

    OMP_NUM_THREADS=1 HYBRID_CACHE=/tmp/hc PYTHONPATH=. python -m hybrid.bench.gradient_fit [--model llama-tiny]
        [--steps 200] [--at 10 50 100 150 200] [--block 256] [--quick]

One exact run of --model at world 1 on the default corpus (the compression benchmarks' config: fp32, --lr, --seq,
the global batch as the gradient accumulation of one rank, so each gradient is the whole batch's, as the DP mean
of a run at dp > 1 is). After the backward of each step in --at, every 2-D gradient goes through the sign codec
and the int4 codec (blocks of --block) in both layouts: as laid out (rows) and transposed (columns: a block is one
input channel, `compression.block_layout=auto` for a row-parallel weight). Reported per kind of weight (the name
with its layer index dropped), the mean over the layers and the steps: the relative error ‖ĝ − g‖/‖g‖, and the
per-column error — each input channel's ‖ĝ_j − g_j‖/‖g_j‖, the mean over channels: an error against each
channel's own scale, as Adam's per-element normalisation sees it. `auto` names the layout the default takes.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick, table
from hybrid.bench.compression_parity import CPU, parity_cfg
from hybrid.bench.inputs import add_train_options
from hybrid.compression.codecs import Codec, Int4Codec, SignCodec
from hybrid.compression.layout import column_spans

MODULE = "hybrid.bench.gradient_fit"
QUICK = {"steps": 3, "at": [1, 3], "seq": 32, "global_batch": 4, "layers": 1, "vocab": 512, "max_chars": 200_000,
         "block": 32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "3 steps of a 1-layer model on a 200,000-character corpus, seconds")
    p.add_argument("--model", default="llama-tiny", help="configs/model")
    add_train_options(p, global_batch=8)
    p.add_argument("--steps", type=int, default=200, help="train.steps (the LR schedule's length)")
    p.add_argument("--at", type=int, nargs="+", default=[10, 50, 100, 150, 200], help="steps whose gradients are read")
    p.add_argument("--block", type=int, default=256, help="compression.block_size")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if min(args.steps, args.block, *args.at) < 1 or max(args.at) > args.steps:
        p.error("--steps and --block must be >= 1, every --at in 1..--steps")
    args.tp, args.settle_window = 1, None  # parity_cfg's knobs: one rank, the config's
    return args


def round_trip(g: torch.Tensor, codec: Codec, by_columns: bool) -> torch.Tensor:
    """`codec`'s encode and decode of the matrix `g`, laid out by rows or (`by_columns`) as its transpose."""
    m = g.t().contiguous() if by_columns else g
    flat = m.reshape(-1)
    approx = codec.decode(codec.encode(flat), flat.numel())[: flat.numel()].view_as(m)
    return approx.t() if by_columns else approx


def errors(g: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(‖ĝ − g‖/‖g‖, the mean over g's nonzero columns of each column's relative error)."""
    cols = g.norm(dim=0)
    live = cols > 0
    per_column = ((approx - g).norm(dim=0)[live] / cols[live]).mean()
    return float((approx - g).norm() / g.norm()), float(per_column)


def fits(g: torch.Tensor, block: int) -> dict[str, tuple[float, float]]:
    """Each codec's errors (relative, per column) on `g` laid out by rows and by columns."""
    codecs = (("sign", SignCodec(block)), ("int4", Int4Codec(block)))
    return {f"{name} {layout}": errors(g, round_trip(g, codec, layout == "columns"))
            for name, codec in codecs for layout in ("rows", "columns")}


def kind(name: str) -> str:
    """A parameter's kind: its name with the layer index dropped (`layers.3.mlp.down.weight` → `mlp.down.weight`)."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else name


def fit_rank(rank: int, world: int, cfg: Any, corpus: Any, at: list[int], block: int) -> list[dict[str, Any]]:
    """Train `cfg` exactly; at each step in `at`, every 2-D gradient's fits (before the optimizer zeroes it)."""
    from hybrid.compression.hooks import make_hook
    from hybrid.parallel.context import ParallelContext
    from hybrid.trainer import Trainer, build_chunks
    from hybrid.validation import validate

    ctx = ParallelContext.build(validate(cfg, world, world))
    hook, state = make_hook(cfg.compression, ctx.dp_group, steps=cfg.train.steps)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, CPU, hook, state)
    rows, zero = [], trainer.grad_sync.zero_grad

    def read_then_zero() -> None:
        if trainer.step + 1 in at:
            for name, p in trainer.model[0].named_parameters():
                if p.grad is not None and p.ndim == 2:
                    auto = "columns" if column_spans([p]) else "rows"
                    rows.append({"step": trainer.step + 1, "kind": kind(name), "auto": auto} | fits(p.grad, block))
        zero()

    trainer.grad_sync.zero_grad = read_then_zero
    for _ in range(cfg.train.steps):
        trainer.train_step()
    return rows


def section(args: argparse.Namespace, out: Callable[[str], None]) -> list[list[Any]]:
    """The run, then one table row per kind of weight."""
    from hybrid.data import prepare_data

    cfg = parity_cfg(args, ["compression=none"])
    found = launch(fit_rank, 1, cfg, prepare_data(cfg.data), sorted(set(args.at)), args.block, timeout=3600.0)[0]
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in found:
        by_kind[r["kind"]].append(r)
    keys = ("sign rows", "sign columns", "int4 rows", "int4 columns")
    body = [[k, rs[0]["auto"], *(f"{statistics.mean(r[key][i] for r in rs):.3f}" for key in keys for i in (0, 1))]
            for k, rs in by_kind.items()]
    out(f"\n## {args.model}, lr {args.lr or 'default'}, seq {args.seq}, global batch {args.global_batch}, "
        f"{args.steps} steps, blocks of {args.block}; means over the layers and steps {sorted(set(args.at))}")
    heads = [f"{k} ({m})" for k in keys for m in ("error", "per column")]
    for line in table(["weight", "auto's layout", *heads], body):
        out(line)
    return body


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[list[Any]]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
