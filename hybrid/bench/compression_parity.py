"""DP gradient compression on gloo CPU ranks: does training with each method reach the uncompressed run's loss?

    OMP_NUM_THREADS=1 HYBRID_CACHE=/tmp/hc PYTHONPATH=. python -m hybrid.bench.compression_parity [--quick]

--model (--layers deep) on the default corpus (configs/data/default.yaml: the stdlib text and a BPE trained on it,
built offline once under $HYBRID_CACHE; --max-chars of it and a --vocab BPE where given), dp=--dp × tp=--tp forked
ranks, one real `Trainer` per run with the same seed, data and hyperparameters; final `evaluate()` loss vs the
uncompressed run, mean compression ratio and error and bytes_dp per step from `mean_bytes()`. An EF run missing the
3% goal runs again with a longer warm-up. Our PowerSGD is set beside PyTorch's powerSGD_hook at the same rank and
warm-up.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.bench import common
from hybrid.bench.common import check_models, launch, parse_with_quick, table, verdict
from hybrid.bench.inputs import add_size_options, size_overrides
from hybrid.compression.defaults import warmup_of
from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.dp.data import DP_GROUPS
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

if TYPE_CHECKING:
    from hybrid.data import Corpus

MODULE = "hybrid.bench.compression_parity"
CPU = torch.device("cpu")
PARITY_RUNS: tuple[tuple[str, tuple[str, ...], bool], ...] = (  # (label, overrides, held to the 3% goal)
    ("none", ("compression=none",), False),
    ("fp16", ("compression=fp16",), True),
    ("bf16", ("compression=bf16",), True),
    ("int8", ("compression=int8",), True),
    ("int4", ("compression=int4",), True),
    ("sign EF", ("compression=sign",), True),
    ("sign no-EF", ("compression=sign", "compression.error_feedback=false"), False),
    ("topk EF", ("compression=topk", "compression.fraction=0.01"), True),
    ("topk no-EF", ("compression=topk", "compression.fraction=0.01", "compression.error_feedback=false"), False),
    ("powersgd EF", ("compression=powersgd", "compression.rank=4"), True),
    ("powersgd no-EF", ("compression=powersgd", "compression.rank=4", "compression.error_feedback=false"), False),
    ("powersgd fixed EF", ("compression=powersgd", "compression.rank=4", "compression.warmup_steps=2",
                           "compression.target_error=0", "compression.factor_dtype=fp32"), True),  # as PyTorch's
    ("powersgd r8 EF", ("compression=powersgd", "compression.rank=8", "compression.target_error=0"), True),
    ("torch_powersgd EF", ("compression=torch_powersgd", "compression.rank=4", "compression.warmup_steps=2"), False),
    ("onebit_adam", ("compression=onebit_adam",), True),  # its warm-up: --warmup-share of the steps
    ("zeroone_adam", ("compression=zeroone_adam",), True),
    ("dgc", ("compression=dgc",), True),  # its sparsity warm-up: --warmup-share of the steps
    ("dgc β1=0", ("compression=dgc", "optim.beta1=0"), True),  # DGC's velocity as the only momentum
    ("sign auto", ("compression=sign", "compression.schedule=auto"), True),  # exact until the loss settles
    ("onebit_adam auto", ("compression=onebit_adam", "compression.schedule=auto", "compression.warmup_steps=0"), True),
)
WARMUP_SHARE = 0.1
PARITY_GOAL = 0.03
QUICK = {"dp": 2, "seq": 32, "micro_batch": 2, "global_batch": 4, "steps": 3, "eval_batches": 1, "error_every": 1,
         "retry_warmup": 0.0, "timeout": 300.0, "settle_window": 1, "layers": 1, "vocab": 512,
         "max_chars": 200_000}


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    common.add_quick(p, "3 steps per run of a 1-layer model on a 200,000-character corpus with a 512-token BPE, "
                    "under a minute")
    p.add_argument("--model", default="gpt-tiny", help="configs/model")
    p.add_argument("--dp", type=int, default=4, help="DP ranks")
    p.add_argument("--tp", type=int, default=1, help="TP ranks (world = dp · tp)")
    p.add_argument("--lr", type=float, default=None, help="train.lr (default: the config's)")
    p.add_argument("--only", default="", help="comma-separated run labels to run (default: all; 'none' always runs)")
    p.add_argument("--settle-window", type=int, default=None, help="compression.settle_window of the auto rows "
                   "(default: the config's)")
    p.add_argument("--seq", type=int, default=64, help="data.seq_len")
    add_size_options(p)
    p.add_argument("--micro-batch", type=int, default=2, help="train.micro_batch_size")
    p.add_argument("--global-batch", type=int, default=8, help="train.global_batch_size")
    p.add_argument("--steps", type=int, default=200, help="train.steps")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out global batches of the final eval")
    p.add_argument("--error-every", type=int, default=10, help="meter compression_error every k steps")
    p.add_argument("--retry-warmup", type=float, default=0.1, help="compression.warmup_steps, as a share of "
                   "--steps, of the second run of an EF method that misses the 3%% goal (0: no second run)")
    p.add_argument("--warmup-share", type=float, default=WARMUP_SHARE, help="onebit_adam's exact warm-up and dgc's "
                   "sparsity warm-up as a share of --steps (not under the auto schedule)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a set of ranks is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; `--quick` makes QUICK's values the defaults (options given explicitly still win)."""
    p = build_parser()
    args = parse_with_quick(p, argv, QUICK)
    check_models(p, args.model)
    if args.dp < 2:
        p.error("--dp must be >= 2")
    if min(args.seq, args.micro_batch, args.steps, args.eval_batches, args.error_every,
           1 if args.layers is None else args.layers) < 1 \
            or args.global_batch % (args.micro_batch * args.dp):
        p.error("sizes must be >= 1 and --global-batch a multiple of --micro-batch · --dp")
    if not 0 <= args.warmup_share < 1:
        p.error("--warmup-share must be in [0, 1)")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command(MODULE, build_parser(), args)


def selected_runs(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], bool]]:
    """PARITY_RUNS, or those `--only` names (and the exact run); the warm-ups of onebit_adam (exact steps) and
    dgc (sparsity) set to --warmup-share of --steps (not under the auto schedule: it finds the warm-up)."""
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    runs = [r for r in PARITY_RUNS if not only or r[0] in only or r[0] == "none"]
    steps = max(1, round(args.warmup_share * args.steps))
    warm = {"compression=onebit_adam": f"compression.warmup_steps={steps}",
            "compression=dgc": f"compression.sparsity_warmup_steps={steps}"}
    def warm_ups(o: tuple[str, ...]) -> tuple[str, ...]:
        return () if "compression.schedule=auto" in o else tuple(w for k, w in warm.items() if k in o)
    return [(label, (*o, *warm_ups(o)), goal) for label, o, goal in runs]


def parity_cfg(args: argparse.Namespace, overrides: Sequence[str]) -> Config:
    """The full training config of one parity run: the default corpus, fp32 CPU, eval only at the end."""
    knobs = size_overrides(args) + ([] if args.lr is None else [f"train.lr={args.lr}"])
    if args.settle_window is not None:
        knobs.append(f"compression.settle_window={args.settle_window}")
    return compose_config([f"model={args.model}", "data=default", f"data.seq_len={args.seq}",
                           f"parallel.tp={args.tp}", "parallel.name=bench", *knobs,
                           f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
                           f"train.steps={args.steps}", "train.eval_every=0", f"train.eval_batches={args.eval_batches}",
                           "train.precision=fp32", "train.device=cpu", "logging.progress=false", *overrides])


def parity_rank(rank: int, world: int, cfg: Config, corpus: Corpus, error_every: int) -> dict[str, Any]:
    """Train `cfg` for train.steps on this rank (as `Trainer.fit`, metering the compression error every
    `error_every` steps), then `evaluate()`; per step the loss and `mean_bytes()`'s figures."""
    ctx = ParallelContext.build(validate(cfg, world, world))
    hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group, cfg.train.steps)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, CPU, hook, state)
    c, steps = cfg.compression, []
    start = time.perf_counter()
    for step in range(cfg.train.steps):
        C.COUNTER.reset()
        metered = c.method != "none" and c.measure_error and (step + 1) % error_every == 0
        trainer.grad_sync.meter(metered)
        result = trainer.train_step()
        trainer.dp.observe(trainer.step, lambda r=result: r.loss)  # the auto schedule, as `Trainer.fit` does
        m = trainer.report.mean_bytes()
        steps.append({"loss": result.loss, "bytes_dp": m["bytes_dp"], "ratio": m.get("compression_ratio"),
                      "error": m.get("compression_error") if metered else None,
                      "wire": sum(C.COUNTER.wire_bytes(g) for g in DP_GROUPS)})  # this rank's, for the run's ratio
    wall = time.perf_counter() - start
    bounds = state.schedule.bounds if state.schedule is not None else [warmup_of(cfg.compression, cfg.train.steps)]
    exact = bounds[0] if bounds else cfg.train.steps  # auto: the step it switched after (never: the whole run)
    return {"steps": steps, "eval": trainer.evaluate(), "s_per_step": wall / cfg.train.steps, "exact_steps": exact}


def parity_ranks(rank: int, world: int, cfgs: list[Config], corpus: Corpus, error_every: int) -> list[dict[str, Any]]:
    """`parity_rank` for each config in turn on the same forked ranks (one launch: the ranks and the process
    group are set up once); each run starts from the same RNG state, as a run of its own would."""
    out = []
    for cfg in cfgs:
        torch.manual_seed(cfg.train.seed)
        out.append(parity_rank(rank, world, cfg, corpus, error_every))
    return out


def parity_runs(args: argparse.Namespace, corpus: Corpus, runs: Sequence[tuple[str, Sequence[str], bool]],
                keep_steps: bool = False) -> list[dict[str, Any]]:
    """The parity runs (label, overrides, held to the goal) on --dp ranks: their rows (with rank 0's figures per
    step under "steps" when `keep_steps`)."""
    cfgs = [parity_cfg(args, overrides) for _, overrides, _ in runs]
    results = launch(parity_ranks, args.dp * args.tp, cfgs, corpus, args.error_every,
                     timeout=args.timeout * len(runs))[0]
    rows = [parity_row(label, o, goal, cfg, res) for (label, o, goal), cfg, res in zip(runs, cfgs, results)]
    return [r | ({"steps": res["steps"]} if keep_steps else {}) for r, res in zip(rows, results)]


def parity_row(label: str, overrides: Sequence[str], goal: bool, cfg: Config, res: dict[str, Any]) -> dict[str, Any]:
    """One run's row, the means taken over the steps after the warm-up (the auto schedule's: its first switch)."""
    warm = res["exact_steps"] if cfg.compression.method != "none" else 0
    after = res["steps"][warm:] or res["steps"]
    errors = [s["error"] for s in after if s["error"] is not None]
    return {"label": label, "method": cfg.compression.method, "warmup": warm, "goal": goal, "eval": res["eval"],
            "ratio": byte_ratio(after), "error": statistics.mean(errors) if errors else None,
            "run_ratio": byte_ratio(res["steps"]),
            "bytes_dp": statistics.mean(s["bytes_dp"] for s in after), "last_loss": res["steps"][-1]["loss"],
            "s_per_step": res["s_per_step"], "overrides": list(overrides)}


def byte_ratio(steps: Sequence[dict[str, Any]]) -> float:
    """Exact ring bytes over sent bytes across `steps` (each step's exact bytes alike): the harmonic mean of the
    steps' `compression_ratio`, a step that sent nothing (no ratio) counting as nothing sent."""
    sent = sum(1 / s["ratio"] for s in steps if s["ratio"])
    return len(steps) / sent if sent else math.inf


def parity_verdicts(rows: list[dict[str, Any]]) -> None:
    """Eval loss relative to the uncompressed run; PASS/FAIL (|relative| ≤ 3%) for the rows held to the 3% target."""
    base = next(r["eval"] for r in rows if r["method"] == "none")
    for r in rows:
        r["rel"] = (r["eval"] - base) / base
        r["pass"] = abs(r["rel"]) <= PARITY_GOAL if r["goal"] else None


def print_parity(args: argparse.Namespace, rows: list[dict[str, Any]], corpus: Corpus,
                 out: Callable[[str], None]) -> None:
    """The parity table and what its columns mean."""
    out(f"\n## parity: {args.model} on the default corpus ({len(corpus.train):,} train / {len(corpus.eval)} "
        f"eval samples of {args.seq}+1 tokens, vocab {corpus.vocab_size}), dp={args.dp} × tp={args.tp} forked gloo "
        f"ranks, lr {args.lr or 'default'}, "
        f"micro batch {args.micro_batch}, global batch {args.global_batch}, {args.steps} steps, the same seed, data "
        f"and hyperparameters for every run; final eval loss over {args.eval_batches} held-out global batches")
    body = [[r["label"], r["warmup"], f"{r['eval']:.4f}", f"{100 * r['rel']:+.2f}%", verdict(r["pass"]),
             f"{r['ratio']:.2f}×", f"{r['run_ratio']:.2f}×", "-" if r["error"] is None else f"{r['error']:.4f}",
             f"{r['bytes_dp']:,.0f}",
             f"{r['last_loss']:.4f}", f"{r['s_per_step']:.3f}"] for r in rows]
    for line in table(["run", "warm-up steps", "final eval loss", "vs none", "within 3%", "mean ratio",
                       "run ratio", "mean error", "bytes_dp/step", "last train loss", "s/step"], body):
        out(line)
    out(f"mean ratio (`compression_ratio`: uncompressed ring wire / DP wire, in bytes summed over the steps; a step "
        f"that sends nothing counts as nothing sent) after the warm-up, run ratio over all steps (warm-up included), "
        f"mean error (`compression_error` = "
        f"‖ĝ − g‖/‖g‖ against the exact DP mean of this step's gradients, metered every {args.error_every} steps; "
        "with error feedback ĝ also carries earlier steps' residuals, so it can exceed 1) and bytes_dp (COUNTER "
        "payload of the DP groups per rank per step) over the steps after the warm-up. 3% goal: fp16, bf16, int8, int4 "
        "and the EF runs of sign, topk and powersgd; the no-EF runs and torch's are context.")


def print_pair(rows: list[dict[str, Any]], out: Callable[[str], None]) -> None:
    """Our PowerSGD next to PyTorch's powerSGD_hook at the same rank and warm-up: bytes and loss."""
    torch_row = next((r for r in rows if r["method"] == "torch_powersgd"), None)
    ours = next((r for r in rows if r["method"] == "powersgd" and torch_row and r["warmup"] == torch_row["warmup"]
                 and "compression.error_feedback=false" not in r["overrides"]
                 and "compression.target_error=0" in r["overrides"]), None)
    if ours is None or torch_row is None:
        return
    out(f"PowerSGD pair (rank 4, error feedback, warm-up {ours['warmup']} steps each: PyTorch needs "
        f"start_powerSGD_iter ≥ 2 with EF): bytes_dp/step ours {ours['bytes_dp']:,.0f} vs torch "
        f"{torch_row['bytes_dp']:,.0f} (same: {ours['bytes_dp'] == torch_row['bytes_dp']}); final eval loss ours "
        f"{ours['eval']:.4f} vs torch {torch_row['eval']:.4f} (ours − torch {ours['eval'] - torch_row['eval']:+.4f}, "
        f"no worse: {ours['eval'] <= torch_row['eval']})")


def section_parity(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Final eval loss of every PARITY_RUNS entry vs the uncompressed run; an EF run missing the 3% goal runs
    again with compression.warmup_steps = --retry-warmup · --steps (both rows shown)."""
    from hybrid.data import prepare_data

    corpus = prepare_data(parity_cfg(args, []).data)
    rows = parity_runs(args, corpus, selected_runs(args))
    parity_verdicts(rows)
    warm = max(1, round(args.retry_warmup * args.steps))
    missed = [r for r in rows if args.retry_warmup > 0 and r["pass"] is False and r["warmup"] < warm]
    retry = [r for i, r in enumerate(missed) if r["label"] not in {m["label"] for m in missed[:i]}]  # once a label
    rows += parity_runs(args, corpus, [(r["label"], [*r["overrides"], f"compression.warmup_steps={warm}"], True)
                                        for r in retry]) if retry else []
    parity_verdicts(rows)
    print_parity(args, rows, corpus, out)
    print_pair(rows, out)
    if retry:
        out(f"second runs with compression.warmup_steps={warm} (≈ {args.retry_warmup:.0%} of the steps) for the EF "
            f"runs that missed the 3% goal: {', '.join(r['label'] for r in retry)}")
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark; returns its rows (for tests)."""
    return common.run_one(section_parity, args, reproduce_command(args), MODULE, out)


if __name__ == "__main__":
    run(parse_args())
