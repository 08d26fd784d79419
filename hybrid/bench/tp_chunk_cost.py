"""What cutting a TP layer's GEMMs into pieces costs on one device: the compute of the chunked overlap without its
communication, against the whole GEMMs.

    PYTHONPATH=. python -m hybrid.bench.tp_chunk_cost [--device cuda] [--dtype bf16] [--model gpt-1b] [--tp 2]
        [--seq 2048] [--batch 1] [--pieces 2 4 8] [--rounds 10] [--quick]

One MLP's forward as one TP rank runs it (--model's hidden and ffn, 1/--tp of the ffn; the sequence-parallel
input gathered): the column-parallel up projection and the row-parallel down projection, each either as one GEMM
over the sequence (`parallel.tp_overlap=none|bulk`) or through the chunked overlap's own code on a group of one:
per piece of the sequence the up projection's output written into place, the down projection's partials made
piece by piece (a ring of one rank: no hop, so no sum arrives to be added) — the single-device cost of the
chunked path. Whole and pieced alternate (A B B A …), --reps calls each, synchronised, timed by the host clock;
reported: the median time of each and the median of the per-round ratios pieced / whole (goal on a GPU: ≤ 1.02
at the pieces a run uses, tp or 2·tp).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hybrid.bench import common
from hybrid.bench.common import check_models, parse_with_quick
from hybrid.config import compose_config
from hybrid.model.family import ffn_hidden
from hybrid.parallel.tp.comm import reduce_scatter_each
from hybrid.parallel.tp.overlap import gathered_linear

MODULE = "hybrid.bench.tp_chunk_cost"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUICK = {"model": "gpt-tiny", "seq": 64, "pieces": [2, 4], "rounds": 4, "reps": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "gpt-tiny, 64 tokens, 4 rounds, seconds")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--model", default="gpt-125m", help="a configs/model name: its hidden and ffn sizes")
    p.add_argument("--tp", type=int, default=2, help="TP size: this rank holds 1/tp of the ffn")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--pieces", type=int, nargs="+", default=[2, 4, 8], help="pieces of the sequence to compare")
    p.add_argument("--rounds", type=int, default=10, help="rounds (A B B A …)")
    p.add_argument("--reps", type=int, default=5, help="calls per side per round")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if min(args.tp, args.seq, args.batch, args.rounds, args.reps, *args.pieces) < 1:
        p.error("--tp, --seq, --batch, --rounds, --reps and --pieces must be >= 1")
    if any(args.seq % n for n in args.pieces):
        p.error(f"every --pieces must divide --seq ({args.seq})")
    return args


def whole(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The up projection over the sequence, then the down projection's partial sums over it."""
    return F.linear(F.linear(x, up), down)


def pieced(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, pieces: int) -> torch.Tensor:
    """The same through the chunked overlap's own code on a group of one (no hop, every piece in hand): the up
    projection piece by piece into place (`overlap.gathered_linear`), the down projection's partials piece by
    piece (`comm.reduce_scatter_each`)."""
    h = gathered_linear(x, up, None, None, pieces)
    return reduce_scatter_each(lambda rows: F.linear(h[:, rows], down), h.shape[1], None, pieces)


def timed(fn: Callable[[], torch.Tensor], reps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def section(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    cfg = compose_config([f"model={args.model}"]).model
    dtype, gen = DTYPES[args.dtype], torch.Generator().manual_seed(0)
    hidden, ffn = cfg.hidden, ffn_hidden(cfg) // args.tp
    x = torch.randn(args.batch, args.seq, hidden, generator=gen).to(args.device, dtype)
    up = (torch.randn(ffn, hidden, generator=gen) * 0.02).to(args.device, dtype)
    down = (torch.randn(hidden, ffn, generator=gen) * 0.02).to(args.device, dtype)
    rows = []
    for n in args.pieces:
        a, b, ratios = [], [], []
        for i in range(args.rounds):
            sides = [lambda: whole(x, up, down), lambda n=n: pieced(x, up, down, n)]
            t = [timed(f, args.reps, args.device) for f in (sides if i % 2 == 0 else sides[::-1])]
            ta, tb = t if i % 2 == 0 else t[::-1]
            a.append(ta)
            b.append(tb)
            ratios.append(tb / ta)
        rows.append({"pieces": n, "whole_ms": 1e3 * statistics.median(a), "pieced_ms": 1e3 * statistics.median(b),
                     "ratio": statistics.median(ratios)})
    out(f"\n## {args.model} MLP as one of tp={args.tp} ranks (hidden {hidden}, ffn/tp {ffn}), {args.batch} × "
        f"{args.seq} tokens, {args.dtype} on {args.device}; median over {args.rounds} rounds × {args.reps} calls")
    out("\n".join(common.table(["pieces", "whole ms", "pieced ms", "pieced / whole"],
                               [[r["pieces"], f"{r['whole_ms']:.3f}", f"{r['pieced_ms']:.3f}", f"{r['ratio']:.3f}"]
                                for r in rows])))
    return {"rows": rows}


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    return common.run_one(section, args, common.reproduce_command(MODULE, build_parser(), args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
