"""The planner against published throughput, predicted from the published layout, hardware and batch: two sources.

    PYTHONPATH=. python -m hybrid.bench.plan_published [--sections megatron,dgxc] [--rows 1.7B,18B] [--rank] [--quick]

**megatron**: Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", SC 2021, Table 1: GPT models of 1.7 B to 1 T parameters on up to 3,072 A100 80 GB
GPUs of NVIDIA's Selene, 8 a node, NVLink inside and 8 HDR InfiniBand links a node). Each row: the model (hidden,
heads, layers; vocabulary 51,200, sequence 2,048, FFN 4h), the published tp and pp on the published GPU count (dp
the rest) and global batch, `--cluster` (dgx-a100); full activation recomputation, as the paper trained, and the
software of its time: the attention kernels (`cost.ATTENTION`'s unfused: the scores materialised, before flash
attention), no sequence parallelism, blocking TP all-reduces, no distributed optimizer, the DP all-reduce after the
backward (`of_2021`). The planner predicts each micro batch (1–16) and schedule (1F1B, interleaved with 2 virtual
stages) of that layout and keeps the fastest; its step time becomes TFLOP/s per GPU by the paper's own count
(96·B·s·l·h²·(1 + s/6h + V/16lh) a step, recomputation included). Reported: published and predicted TFLOP/s per GPU
and their ratio (goal: within 20 %), and with `--rank` the published layout's place among every (tp, pp) the
planner predicts for the same GPUs and batch (goal: top three; memory is not checked there).

**dgxc**: NVIDIA's DGX Cloud benchmarking recipes for Llama 3.1 (github.com/NVIDIA/dgxc-benchmarking, release
v24.11.1, commit 35a9aecc8d5b17d99d80f52f38c75ade0dbab7ae, `llama3.1/README_{8b,70b,405b}.md` and the layouts in
`llama3.1/llama3.1_{8b,70b,405b}.yaml`: NeMo 24.09, Megatron-Core, bf16, DGX H100 80 GB, 8 a node, NVLink 4 inside
and 8 × 400 Gb/s InfiniBand a node), the `dgx-h100` preset. Each row: the model (Llama 3: GQA with 8 KV heads,
SwiGLU, vocabulary 128,256, sequence 8,192) on the published GPUs with the published tp, pp, virtual stages, cp
(dp the rest), micro batch 1 and global batch; no recomputation, the distributed optimizer with its overlaps,
sequence parallelism and TP overlap under TP, flash attention, equal layer counts per stage (`of_dgxc`). Reported:
published and predicted tokens/s per GPU (the recipes' throughput: sequence × global batch over the step time)
and their ratio (goal: within 20 %).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from hybrid.bench import common
from hybrid.config import compose_config
from hybrid.plan.cost import Shape
from hybrid.plan.hardware import Cluster, PlanError, preset
from hybrid.plan.predict import Candidate, Prediction, predict
from hybrid.plan.search import Job, candidates, fastest, plan
from hybrid.trainer import build_chunks

MODULE = "hybrid.bench.plan_published"
VOCAB, SEQ = 51200, 2048
KERNEL = "unfused"  # 2021's Megatron-LM: materialised scores, fused scale-mask-softmax (flash attention came in 2022)


@dataclass(frozen=True)
class Row:
    """One published configuration: the model, its layout and batch, the TFLOP/s per GPU reported."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    def shape(self) -> Shape:
        return Shape(self.layers, self.hidden, self.heads, self.heads, 4 * self.hidden, VOCAB, False)

    def flops_per_step(self) -> float:
        """The paper's count: 96·B·s·l·h²·(1 + s/6h + V/16lh) (forward, backward and the recomputed forward)."""
        b, s, n, h = self.batch, SEQ, self.layers, self.hidden
        return 96 * b * s * n * h * h * (1 + s / (6 * h) + VOCAB / (16 * n * h))


MEGATRON = [  # Narayanan et al. 2021, Table 1 (TFLOP/s per GPU, end to end)
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), Row("18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39B", 64, 8192, 48, 8, 2, 512, 1536, 138), Row("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148), Row("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163), Row("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@dataclass(frozen=True)
class Llama:
    """One published Llama 3.1 run: the model, its layout and batch, the tokens/s per GPU reported."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    gpus: int
    tp: int
    pp: int
    v: int
    cp: int
    batch: int
    tokens: float

    def shape(self) -> Shape:
        return Shape(self.layers, self.hidden, self.heads, 8, self.ffn, LLAMA_VOCAB, True, tied=False)

    def candidate(self) -> Candidate:
        """The layout as NeMo 24.09 ran it (`of_dgxc`)."""
        dp = self.gpus // (self.tp * self.pp * self.cp)
        return of_dgxc(Candidate(self.tp, self.pp, dp, 1, cp=self.cp, v=self.v, recompute="none"))

    def job(self) -> Job:
        cfg = compose_config(["model=llama-1b", f"model.n_layers={self.layers}", f"model.hidden={self.hidden}",
                              f"model.n_heads={self.heads}", "model.n_kv_heads=8", f"model.ffn_hidden={self.ffn}",
                              "model.tie_embeddings=false", f"model.max_seq_len={LLAMA_SEQ}"])
        return Job(cfg, self.shape(), self.batch, LLAMA_SEQ)


def of_dgxc(c: Candidate) -> Candidate:
    """`c` as NeMo 24.09 ran it: the distributed optimizer (its overlaps on), sequence parallelism and TP overlap
    under TP, the flat DP exchange, equal layer counts per stage."""
    return replace(c, zero=1, tp_overlap="chunked" if c.tp > 1 else "none", sequence_parallel=True,
                   dp_exchange="flat", stage_layers="equal")


LLAMA_VOCAB, LLAMA_SEQ = 128256, 8192
DGXC = [  # dgxc-benchmarking v24.11.1, llama3.1 README tables (bf16; total tokens/s over the GPUs)
    Llama("8B-8", 32, 4096, 32, 14336, 8, 1, 1, 1, 2, 128, 10153),
    Llama("8B-128", 32, 4096, 32, 14336, 128, 1, 1, 1, 2, 2048, 10006),
    Llama("70B-64", 80, 8192, 64, 28672, 64, 4, 4, 5, 2, 128, 1113),
    Llama("70B-1024", 80, 8192, 64, 28672, 1024, 4, 4, 5, 2, 2048, 1098),
    Llama("405B-576", 126, 16384, 128, 53248, 576, 8, 9, 7, 2, 252, 208.4),
]
SECTIONS = ("megatron", "dgxc")
QUICK = {"rows": "1.7B,39B,8B-8", "sections": "megatron,dgxc"}
RANK_MICRO = (1, 2, 4)  # the micro batches the ranking tries for every (tp, pp): pp = 64 has 512 microbatches to replay
RANK_TOP = 24  # fitting layouts the ranking collects: at least 3 distinct (tp, pp) past 6 variants of each


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "two rows, no ranking")
    common.add_sections(p, SECTIONS)
    p.add_argument("--rows", default=",".join(r.name for r in [*MEGATRON, *DGXC]), help="the tables' rows, by name")
    p.add_argument("--cluster", default="dgx-a100", help="the hardware preset (hybrid.plan.hardware.CLUSTERS)")
    p.add_argument("--rank", action="store_true", help="also rank the published layout among all the planner predicts")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = common.parse_with_quick(p, argv, QUICK, SECTIONS)
    names = {r.name for r in [*MEGATRON, *DGXC]}
    unknown = [n for n in args.rows.split(",") if n not in names]
    if unknown:
        p.error(f"unknown rows {unknown}; the table has {', '.join(sorted(names))}")
    return args


def best_of(row: Row, layouts: list[Candidate], cluster_name: str) -> Prediction:
    cluster = preset(cluster_name, row.gpus // 8)
    return min((predict(row.shape(), c, cluster, row.batch, SEQ, kernel=KERNEL) for c in layouts),
               key=lambda p: p.step_s)


def of_2021(c: Candidate) -> Candidate:
    """`c` as 2021's Megatron-LM ran: no sequence parallelism, blocking TP all-reduces, no distributed optimizer, the
    data-parallel all-reduce (one flat ring) after the backward, equal layer counts per stage."""
    return replace(c, sequence_parallel=False, tp_overlap="none", zero=0, dp_overlap=False, dp_exchange="flat",
                   stage_layers="equal")


def published_layouts(row: Row, cluster_name: str) -> list[Candidate]:
    """Every micro batch and schedule of the published tp and pp, with full recomputation."""
    cluster = preset(cluster_name, row.gpus // 8)
    return list(dict.fromkeys(of_2021(c) for c in candidates(row.shape(), cluster, row.batch)
                              if (c.tp, c.pp, c.recompute) == (row.tp, row.pp, "full")))


def rank_of(job: Job, cluster: Cluster, layouts: list[Candidate], key: Callable[[Candidate], tuple],
            published: tuple) -> dict[str, str]:
    """The published layout's place among the distinct `key`s (tp, pp[, cp]) of the fastest layouts, those that fit
    hybrid's memory estimate (`search.plan`) and all of them; and how much slower than the fastest that fits the
    planner predicts the published key's fastest variant."""
    ranked = list(itertools.islice(fastest(job, cluster, layouts), RANK_TOP * 4))
    mine = min((p.step_s for p in ranked if key(p.candidate) == published), default=None)
    try:
        plans, _ = plan(job, cluster, lambda cfg: lambda ctx: build_chunks(cfg, job.shape.vocab, ctx), RANK_TOP,
                        layouts=layouts)
    except PlanError:
        plans = []
    gap = f"{mine / plans[0].step_s - 1:+.1%}" if plans and mine else "-"
    return {"fits": _place([key(p.candidate) for p in plans], published),
            "any": _place([key(p.candidate) for p in ranked], published), "gap": gap}


RANKS = ("rank (fits)", "rank (any memory)", "gap")


def _rank_cells(g: dict[str, Any]) -> list[str]:
    rank = g["rank"]
    return [rank["fits"], rank["any"], rank["gap"]] if rank else ["-", "-", "-"]


def _place(keys: list[tuple], published: tuple) -> str:
    distinct = list(dict.fromkeys(keys))
    return str(distinct.index(published) + 1) if published in distinct else f"> {len(distinct)}"


def megatron_job(row: Row) -> Job:
    cfg = compose_config(["model=gpt-1b", f"model.n_layers={row.layers}", f"model.hidden={row.hidden}",
                          f"model.n_heads={row.heads}", f"model.ffn_hidden={4 * row.hidden}",
                          f"model.vocab_size={VOCAB}", f"model.max_seq_len={SEQ}"])
    return Job(cfg, row.shape(), row.batch, SEQ, KERNEL)


def dgxc_rank(row: Llama, cluster: Cluster) -> dict[str, str]:
    """Among every (tp, pp, cp) of the row's GPUs and batch, NeMo's software, no recomputation, micro batch 1–4."""
    layouts = list(dict.fromkeys(of_dgxc(c) for c in candidates(row.shape(), cluster, row.batch, LLAMA_SEQ)
                                 if c.recompute == "none" and c.micro in RANK_MICRO))
    return rank_of(row.job(), cluster, layouts, lambda c: (c.tp, c.pp, c.cp), (row.tp, row.pp, row.cp))


def megatron_rank(row: Row, cluster_name: str) -> dict[str, str]:
    """Among every (tp, pp) of the row's GPUs and batch, 2021's software, full recomputation, micro batch 1–4."""
    cluster = preset(cluster_name, row.gpus // 8)
    layouts = list(dict.fromkeys(of_2021(c) for c in candidates(row.shape(), cluster, row.batch)
                                 if c.recompute == "full" and c.micro in RANK_MICRO))
    return rank_of(megatron_job(row), cluster, layouts, lambda c: (c.tp, c.pp), (row.tp, row.pp))


def dgxc(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """NVIDIA's Llama 3.1 runs on DGX H100, each predicted at its published layout on `dgx-h100`."""
    rows = [r for r in DGXC if r.name in args.rows.split(",")]
    got = []
    for row in rows:
        cluster = preset("dgx-h100", row.gpus // 8)
        p = predict(row.shape(), row.candidate(), cluster, row.batch, LLAMA_SEQ)
        got.append({"row": row.name, "published": row.tokens, "predicted": p.tokens_per_s_per_gpu,
                    "ratio": p.tokens_per_s_per_gpu / row.tokens, "layout": p.candidate.label(), "parts": p.parts,
                    "rank": dgxc_rank(row, cluster) if args.rank else None})
    out("\n## NVIDIA dgxc-benchmarking Llama 3.1 on dgx-h100 (tokens/s per GPU)")
    out("\n".join(common.table(["model", "GPUs", "tp", "pp", "v", "cp", "published", "predicted", "ratio", *RANKS],
                               [[r.name, r.gpus, r.tp, r.pp, r.v, r.cp, f"{r.tokens:,.0f}", f"{g['predicted']:,.0f}",
                                 f"{g['ratio']:.2f}", *_rank_cells(g)] for g, r in zip(got, rows)])))
    return _verdict(got, out)


def _verdict(got: list[dict[str, Any]], out: Callable[[str], None]) -> list[dict[str, Any]]:
    errors = [abs(g["ratio"] - 1) for g in got]
    if errors:
        out(f"\nwithin 20 %: {sum(e <= 0.2 for e in errors)} of {len(got)}; median |error| "
            f"{statistics.median(errors):.1%}")
    return got


def megatron(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = [r for r in MEGATRON if r.name in args.rows.split(",")]
    got = []
    for row in rows:
        best = best_of(row, published_layouts(row, args.cluster), args.cluster)
        tflops = row.flops_per_step() / best.step_s / row.gpus / 1e12
        got.append({"row": row.name, "published": row.tflops, "predicted": tflops, "ratio": tflops / row.tflops,
                    "layout": best.candidate.label(), "rank": megatron_rank(row, args.cluster) if args.rank else None,
                    "parts": best.parts})
    out(f"\n## Megatron-LM Table 1 on {args.cluster} (TFLOP/s per GPU, the paper's count)")
    out("\n".join(common.table(["model", "GPUs", "tp", "pp", "published", "predicted", "ratio", "layout", *RANKS],
                               [[g["row"], r.gpus, r.tp, r.pp, r.tflops, f"{g['predicted']:.0f}", f"{g['ratio']:.2f}",
                                 g["layout"], *_rank_cells(g)] for g, r in zip(got, rows)])))
    return _verdict(got, out)


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    command = common.reproduce_command(MODULE, build_parser(), args)
    return common.run_sections((("megatron", megatron), ("dgxc", dgxc)), args, command, MODULE, out)


if __name__ == "__main__":
    run(parse_args())
