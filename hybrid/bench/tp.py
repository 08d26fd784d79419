"""Tensor parallelism on gloo CPU ranks: parameter memory, saved activations, tokens/s and TP bytes per step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m hybrid.bench.tp [--sections params,activations,throughput,bytes]

Every figure comes from real ranks: forked processes (1 torch thread each) joined in a gloo group over
local TCP, one set of ranks alive at a time. Sections:

- params: each rank of a TP group of t ranks builds `build_model(cfg, vocab, tp_group)` of --param-model
  (embedding included) and sums numel · element_size of its parameters; printed per rank against 1/t of
  tp=1 (goal: ratio ≤ 1.05; replicated norms, row biases and positions and the vocabulary padding exceed 1/t).
- activations: one training-mode forward (loss included) of --act-model cut to --act-layers layers on
  --act-batch × --act-seq tokens; `saved_tensors_hooks` tallies the unique storages autograd saves for
  backward (each storage's nbytes once, parameters' storages excluded), split into the transformer layers
  and the ends (embedding, final norm, head, loss). Under SP a column-parallel layer saves only its
  [b, s/t, h] input chunk (re-gathered in backward). Megatron's per-layer estimate
  (Korthikanti et al. 2022, 16-bit, dropout masks, attention scores stored) is printed as context only.
- throughput: 2 ranks, the same model, global batch and data: tp=1 (dp=2), tp=2 (dp=1) and tp=2+SP,
  each a real `Trainer`; the three alternate in rounds (ABC CBA …), each round --warmup untimed then
  --steps timed steps between barriers. Reported: median step time, tokens/s and the median of the
  per-round ratios against tp=1. On a 2-core CPU this measures collective and slicing overhead, not speed-up.
- bytes: one `Trainer.train_step` at tp=t (dp=1): `COUNTER` bytes of group "tp" per op against
  `tp_bytes_per_microbatch` × microbatches, plus per step the SP gradient all-reduce
  (`sequence_parallel_grad_elements` × 4) and the 4-byte grad-norm all-reduce.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from hybrid.bench import common
from hybrid.bench.common import check_models, split_sections
from hybrid.bench.ranks import launch
from hybrid.compression.hooks import make_hook
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.model import build_model
from hybrid.model.traffic import tp_bytes_per_step
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.trainer import Trainer

SECTIONS = ("params", "activations", "throughput", "bytes")
VARIANTS = (("tp1·dp2", 1, False), ("tp2", 2, False), ("tp2+SP", 2, True))  # the throughput contenders
MB = 2**20


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog="python -m hybrid.bench.tp", description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="TP sizes of params/activations/bytes")
    p.add_argument("--param-model", default="gpt-350m", help="configs/model of the params section")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: model.vocab_size, else 8192)")
    p.add_argument("--act-model", default="gpt-350m", help="configs/model of the activations section")
    p.add_argument("--act-layers", type=int, default=4, help="layers of the activations model")
    p.add_argument("--act-seq", type=int, default=512, help="tokens per sequence, activations")
    p.add_argument("--act-batch", type=int, default=1, help="sequences per microbatch, activations")
    p.add_argument("--model", default="gpt-tiny", help="configs/model of the throughput and bytes sections")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence, throughput and bytes")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender per round")
    p.add_argument("--rounds", type=int, default=10, help="throughput rounds (ABC CBA …)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a set of ranks is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the defaults are the full run (~3–5 minutes on 2 cores)."""
    p = build_parser()
    args = p.parse_args(argv)
    split_sections(p, args, SECTIONS)
    check_models(p, args.param_model, args.act_model, args.model)
    if min(args.tp) < 1 or min(args.act_layers, args.act_seq, args.act_batch, args.seq, args.steps, args.rounds) < 1:
        p.error("--tp, --act-*, --seq, --steps and --rounds must be >= 1")
    if args.global_batch % (2 * args.micro_batch) or args.seq % max(args.tp) or args.act_seq % max(args.tp):
        p.error("--global-batch must divide by 2·--micro-batch, --seq and --act-seq by every --tp")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every setting spelled out."""
    return common.reproduce_command("hybrid.bench.tp", build_parser(), args)


def tp_context(world: int, tp: int) -> ParallelContext:
    """The mesh of `world` ranks with TP size `tp` (dp = world / tp), its groups named for COUNTER."""
    ctx = ParallelContext.build(Layout.create(world, tp=tp))
    C.name_group(ctx.tp_group, "tp")
    C.name_group(ctx.dp_group, "dp")
    return ctx


def resolve_vocab(cfg: Any, override: Optional[int]) -> int:
    """--vocab, else the model's vocab_size, else the default tokenizer's data.vocab_size (8192)."""
    return override or cfg.model.vocab_size or cfg.data.vocab_size


# ---- params ----------------------------------------------------------------------------------------------------

def params_rank(rank: int, world: int, model_cfg: Any, vocab: int) -> dict[str, float]:
    """Parameter bytes of this rank's shard of the whole model (TP group = all `world` ranks)."""
    ctx = tp_context(world, world)
    start = time.perf_counter()
    model = build_model(model_cfg, vocab, ctx.tp_group, seed=0)
    build_s = time.perf_counter() - start
    return {"bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "build_s": build_s,
            "padded_vocab": model.padded_vocab}


def section_params(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Build the model at every --tp (one set of ranks at a time); bytes per rank vs 1/t of tp=1."""
    cfg = compose_config([f"model={args.param_model}"])
    vocab = resolve_vocab(cfg, args.vocab)
    sizes = sorted(set(args.tp) | {1})
    rows = []
    for t in sizes:
        per_rank = launch(params_rank, t, cfg.model, vocab, timeout=args.timeout)
        rows.append({"tp": t, "bytes": max(r["bytes"] for r in per_rank), "padded_vocab": per_rank[0]["padded_vocab"],
                     "build_s": max(r["build_s"] for r in per_rank)})
    base = rows[0]["bytes"]
    out(f"\n## params: {args.param_model}, vocab {vocab}, fp32, whole model (embedding included) per rank")
    out("tp | padded vocab | bytes per rank               | 1/t of tp=1  | ratio  | within 5% | build s")
    out("---|--------------|------------------------------|--------------|--------|-----------|--------")
    for r in rows:
        r["ratio"] = r["bytes"] / (base / r["tp"])
        out(f"{r['tp']:2d} | {r['padded_vocab']:12d} | {r['bytes']:11d} ({r['bytes'] / MB:7.1f} MiB)   | "
            f"{base / r['tp'] / MB:8.1f} MiB | {r['ratio']:.4f} | {str(r['ratio'] <= 1.05):9s} | {r['build_s']:6.1f}")
    return rows


# ---- activations -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def saved_tally(model: torch.nn.Module) -> Iterator[dict[int, tuple[str, int]]]:
    """{storage ptr: (region, nbytes)} of what the forward inside saves for backward.

    region: "layers" inside a transformer block, else "ends".
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    region = ["ends"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in params and ptr not in seen and storage.nbytes():
            seen[ptr] = (region[0], storage.nbytes())
        return t

    blocks = list(model.layers.values())
    handles = [b.register_forward_pre_hook(lambda *_: region.__setitem__(0, "layers")) for b in blocks]
    handles += [b.register_forward_hook(lambda *_: region.__setitem__(0, "ends")) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield seen
    finally:
        for h in handles:
            h.remove()


def activations_rank(rank: int, world: int, model_cfg: Any, vocab: int, batch: int, seq: int) -> list[dict]:
    """Saved-activation bytes of one forward at tp=world, without and (tp > 1) with SP."""
    ctx = tp_context(world, world)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for sp in (False, True) if world > 1 else (False,):
        model = build_model(model_cfg, vocab, ctx.tp_group, seed=0, sequence_parallel=sp).train()
        with saved_tally(model) as seen:
            loss = model(ids[:, :-1], ids[:, 1:])
        part = {r: sum(n for rr, n in seen.values() if rr == r) for r in ("layers", "ends")}
        rows.append({"tp": world, "sp": sp, "layers": part["layers"], "ends": part["ends"]})
        del loss, model
    return rows


def megatron_per_layer(s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Korthikanti et al. 2022, bytes per layer in 16-bit: sbh(10 + 24/t + 5as/(ht)), SP: sbh(34/t + 5as/(ht))."""
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))


def section_activations(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Saved-activation bytes per rank at every --tp, with and without SP, and the SP/no-SP ratio."""
    cfg = compose_config([f"model={args.act_model}", f"model.n_layers={args.act_layers}"])
    m, vocab, s, b = cfg.model, resolve_vocab(cfg, args.vocab), args.act_seq, args.act_batch
    rows = []
    for t in sorted(set(args.tp)):
        per_rank = launch(activations_rank, t, m, vocab, b, s, timeout=args.timeout)
        rows += [max(rs, key=lambda r: r["layers"] + r["ends"]) for rs in zip(*per_rank)]
    out(f"\n## activations: {args.act_model} cut to {m.n_layers} layers, vocab {vocab}, b={b}, s={s}, fp32, "
        "bytes autograd saves in one forward per rank (parameters excluded)")
    out("config  | per layer MiB | ends MiB | total MiB | SP/no-SP per layer | Megatron 16-bit per layer MiB (context)")
    out("--------|---------------|----------|-----------|--------------------|----------------------------------------")
    plain = {r["tp"]: r["layers"] for r in rows if not r["sp"]}
    for r in rows:
        name = f"tp{r['tp']}" + ("+SP" if r["sp"] else "")
        ratio = f"{r['layers'] / plain[r['tp']]:.3f}" if r["sp"] else "-"
        mega = megatron_per_layer(s, b, m.hidden, m.n_heads, r["tp"], r["sp"])
        out(f"{name:7s} | {r['layers'] / m.n_layers / MB:13.2f} | {r['ends'] / MB:8.1f} | "
            f"{(r['layers'] + r['ends']) / MB:9.1f} | {ratio:>18s} | {mega / MB:8.2f}")
    out("Megatron's estimate assumes 16-bit activations, 1-byte dropout masks and stored attention scores "
        "(5as/h term); ours are fp32, dropout 0, fused SDPA (no s² scores): compare the SP/no-SP trend, not bytes.")
    return rows


# ---- throughput and bytes --------------------------------------------------------------------------------------

def synthetic_corpus(vocab: int, seq_len: int, n: int, seed: int = 0) -> Corpus:
    """`n` train + 8 eval samples of `seq_len + 1` uniform random tokens in [0, vocab)."""
    rng = np.random.default_rng(seed)
    samples = rng.integers(0, vocab, size=(n + 8, seq_len + 1), dtype=np.int64).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples[:n], eval=samples[n:], seq_len=seq_len)


def train_cfg(args: argparse.Namespace, steps: int) -> Any:
    """The composed config of the throughput and bytes runs (fp32 on CPU, no eval)."""
    return compose_config([f"model={args.model}", f"data.seq_len={args.seq}", f"train.steps={steps}",
                           f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
                           "train.eval_every=0", "train.precision=fp32", "train.device=cpu"])


def make_trainer(cfg: Any, corpus: Corpus, world: int, tp: int, sp: bool) -> Trainer:
    """A real Trainer on the mesh of `world` ranks with TP size `tp` (dp = world / tp)."""
    ctx = tp_context(world, tp)
    model = build_model(cfg.model, corpus.vocab_size, ctx.tp_group, seed=cfg.train.seed, sequence_parallel=sp)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, model, corpus, torch.device("cpu"), hook, state)


def throughput_rank(rank: int, world: int, cfg: Any, corpus: Corpus, rounds: int, warmup: int,
                    steps: int) -> dict[str, Any]:
    """Per-round seconds per step and every loss of each VARIANTS contender, alternated ABC CBA …"""
    trainers = {name: make_trainer(cfg, corpus, world, tp, sp) for name, tp, sp in VARIANTS}
    times: dict[str, list[float]] = {n: [] for n in trainers}
    losses: dict[str, list[float]] = {n: [] for n in trainers}
    for i in range(rounds):
        for name in list(trainers) if i % 2 == 0 else list(reversed(trainers)):
            for _ in range(warmup):
                losses[name].append(trainers[name].train_step().loss)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                losses[name].append(trainers[name].train_step().loss)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {"times": times, "losses": losses}


def section_throughput(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    """tokens/s of tp=1·dp=2, tp=2 and tp=2+SP on 2 ranks, the same global batch, side by side."""
    cfg = train_cfg(args, args.rounds * (args.warmup + args.steps))
    corpus = synthetic_corpus(resolve_vocab(cfg, args.vocab), args.seq, max(64, 4 * args.global_batch))
    res = launch(throughput_rank, 2, cfg, corpus, args.rounds, args.warmup, args.steps, timeout=args.timeout)[0]
    tokens = args.global_batch * args.seq
    base = res["times"][VARIANTS[0][0]]
    out(f"\n## throughput: {args.model}, 2 ranks × 1 thread, step = {args.global_batch} seqs × {args.seq} tokens "
        f"= {tokens} tokens (micro batch {args.micro_batch}), {args.rounds} rounds × ({args.warmup} warmup + "
        f"{args.steps} timed) steps each")
    out("config  | median s/step | median tok/s | tok/s vs tp1·dp2 (median of rounds) | min..max rounds | "
        "first loss | last loss")
    out("--------|---------------|--------------|-------------------------------------|-----------------|"
        "------------|----------")
    for name, _, _ in VARIANTS:
        t, loss = res["times"][name], res["losses"][name]
        ratios = [b / x for b, x in zip(base, t)]
        out(f"{name:7s} | {statistics.median(t):13.3f} | {tokens / statistics.median(t):12.1f} | "
            f"{statistics.median(ratios):34.3f}× | {min(ratios):.3f}..{max(ratios):.3f}    | "
            f"{loss[0]:10.6f} | {loss[-1]:.6f}")
    out("2 CPU cores: tp=2 halves each rank's matmuls but adds 4 all-reduces of b·s·h per layer and microbatch; "
        "the ratio measures that collective/slicing overhead against dp=2's one gradient all-reduce per step.")
    return res


def bytes_rank(rank: int, world: int, cfg: Any, corpus: Corpus) -> list[dict[str, Any]]:
    """COUNTER's "tp" bytes per op of one train_step at tp=world, without and with SP."""
    rows = []
    for sp in (False, True):
        trainer = make_trainer(cfg, corpus, world, world, sp)
        C.COUNTER.reset()
        trainer.train_step()
        counted = {op: b for (g, op), b in C.COUNTER.bytes.items() if g == "tp"}
        rows.append({"tp": world, "sp": sp, "counted": counted, "microbatches": trainer.num_microbatches,
                     "wire": C.COUNTER.wire_bytes("tp")})
    return rows


def section_bytes(args: argparse.Namespace, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Counted vs analytic TP bytes of one step at every --tp > 1, with and without SP."""
    cfg = train_cfg(args, 1)
    corpus = synthetic_corpus(resolve_vocab(cfg, args.vocab), args.seq, max(64, 4 * args.global_batch))
    rows = []
    for t in sorted(t for t in set(args.tp) if t > 1):
        rows += launch(bytes_rank, t, cfg, corpus, timeout=args.timeout)[0]
    out(f"\n## bytes_tp per step: {args.model}, step = {args.global_batch} seqs × {args.seq} tokens, micro batch "
        f"{args.micro_batch}, dp=1 (COUNTER payload bytes of group 'tp' on one rank vs traffic.py's formula)")
    out("config  | op             | counted      | analytic     | equal")
    out("--------|----------------|--------------|--------------|------")
    for r in rows:
        r["analytic"] = tp_bytes_per_step(cfg.model, args.micro_batch, args.seq, r["tp"], r["sp"], r["microbatches"])
        name = f"tp{r['tp']}" + ("+SP" if r["sp"] else "")
        for op in sorted(set(r["counted"]) | set(r["analytic"])) + ["total"]:
            c = sum(r["counted"].values()) if op == "total" else r["counted"].get(op, 0)
            a = sum(r["analytic"].values()) if op == "total" else r["analytic"].get(op, 0)
            out(f"{name:7s} | {op:14s} | {c:12d} | {a:12d} | {c == a}")
        out(f"{name:7s} | ring wire bytes one rank sends: {r['wire']:.0f} (all-reduce 2(t−1)/t, others (t−1)/t)")
        r["equal"] = r["counted"] == r["analytic"]
    return rows


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections in order; returns their rows (for tests)."""
    sections = (("params", section_params), ("activations", section_activations),
                     ("throughput", section_throughput), ("bytes", section_bytes))
    return common.run_sections(sections, args, reproduce_command(args), "hybrid.bench.tp", out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0, or 1 when a counted TP byte figure differs from the analytic one."""
    result = run(parse_args(argv))
    return 0 if all(r["equal"] for r in result.get("bytes", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
