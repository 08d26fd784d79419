"""Context parallelism in training, against the single-process run.

Each case trains 2 steps of a 2-layer model on sequences of 24 tokens from the same init and data as one process
without CP; the losses and gradient norms of every step equal the reference's within fp32 rounding (rtol 1e-5:
the attention's and the gradients' summation orders differ) — so the loss averages over every token of the
global batch exactly as without CP, the positions (GPT's learned, Llama's RoPE) follow each token's true index,
and the gradients averaged over CP × DP are the whole batch's. The last step's record (`bytes_cp`,
`comm/cp/<op>/bytes`) equals `model.traffic.cp_bytes_per_microbatch` over its microbatches and layers; the
ring's has `comm/overlap_cp`.

Cases: GPT ring cp2 and Llama (GQA) all-to-all cp2 on 2 ranks; Llama ring cp3 (odd) on 3; on 4 ranks GPT ring
cp2dp2 with ZeRO-1, Llama cp2dp2 with ZeRO-3, Llama ring cp2tp2 with sequence parallelism (and TP's exchanges
pipelined around the TP ring: `parallel.tp_overlap=chunked`), GPT all-to-all
cp2pp2 (1F1B), Llama ring cp2pp2 under zero-bubble's split backward (zb1p), GPT ring cp2pp2 under zbv (4 layers),
GPT ring cp4, Llama all-to-all cp4, Llama ring cp2pp2 interleaved (4 layers), GPT ring cp2pp2 GPipe. Dropout
(`test_dropout_under_context_parallelism`): masks cannot match one process's, so the tests hold what must hold
instead. Within bf16 rounding of one process: Llama ring cp2 under bf16 parameters with full recomputation, GPT
cp2dp2 with the gradient sync compressed to bf16. Configs are composed and validated in the test process before
the ranks fork.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from harness import run_ranks
from test_dp import synthetic_corpus

from hybrid.config import compose_config
from hybrid.model.traffic import cp_bytes_per_microbatch
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.rng import stage_seed
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

SEQ, STEPS = 24, 2  # the second step (timed, for its record) already depends on the first update
CASES = {2: [("gpt", ["parallel.cp=2"]), ("llama", ["parallel.cp=2", "parallel.cp_comm=a2a"])],
         3: [("llama", ["parallel.cp=3"])],
         4: [("gpt", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"]),
             ("llama", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
             ("llama", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "parallel.tp_overlap=chunked"]),
             ("gpt", ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm=a2a"]),
             ("llama", ["parallel.cp=2", "parallel.pp=2", "parallel.schedule=zb1p", "parallel.zb_memory=none"]),
             ("gpt", ["parallel.cp=2", "parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2",
                      "parallel.zb_memory=none", "model.n_layers=4"]),
             ("gpt", ["parallel.cp=4"]), ("llama", ["parallel.cp=4", "parallel.cp_comm=a2a"]),
             ("llama", ["parallel.cp=2", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                        "model.n_layers=4"]),
             ("gpt", ["parallel.cp=2", "parallel.pp=2", "parallel.schedule=gpipe", "model.dropout=0"])]}
DROPOUT = [(family, ["parallel.cp=2", f"parallel.cp_comm={comm}", "model.dropout=0.2", *recompute])
           for family, comm in (("gpt", "ring"), ("llama", "a2a")) for recompute in ([], ["train.recompute=selective"])]
"""Dropout > 0 on 2 ranks: each exchange without and with selective recomputation, which reruns the attention
and must draw the same masks again."""
LOOSE = {2: [("llama", ["parallel.cp=2", "train.precision=bf16_params", "train.recompute=full"])],
         4: [("gpt", ["parallel.cp=2", "parallel.dp=2", "compression=bf16"])]}
"""Within bf16 rounding of the single process: bf16 parameters with full recomputation (the ring merges in fp32
where the single process's kernel rounds its output to bf16); a bf16-compressed gradient sync on the cp-dp group
of 4 ranks."""


@functools.cache
def config(family: str, extra: tuple[str, ...], world: int) -> Any:
    cfg = compose_config([
        f"model={family}-tiny", "model.n_layers=2", "model.hidden=64", "model.n_heads=4", "model.max_seq_len=32",
        "model.ffn_hidden=128", "model.dropout=0", f"data.seq_len={SEQ}", "train.global_batch_size=8",
        "train.micro_batch_size=2", f"train.steps={STEPS}", "train.eval_every=0", "train.lr=3e-3",
        "optim.warmup_steps=1", "parallel.bucket_mb=0.1", *extra])
    validate(cfg, world)
    return cfg


def train(cfg: Any, world: int) -> dict[str, Any]:
    p = cfg.parallel
    layout = Layout.create(world, tp=p.tp, pp=p.pp, cp=p.cp) if world > 1 else Layout(world=1)
    ctx = ParallelContext.build(layout)
    torch.manual_seed(stage_seed(cfg.train.seed, ctx.pp_rank, ctx.cp_rank))  # as hybrid.train seeds each run
    corpus = synthetic_corpus(seq=SEQ)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, torch.device("cpu"))
    steps = [trainer.train_step() for _ in range(STEPS - 1)]
    C.COUNTER.reset()
    steps.append(trainer.train_step(timed=True))  # the record of a logged, timed step
    record = trainer.step_metrics(steps[-1])
    return {"losses": [s.loss for s in steps], "norms": [s.grad_norm for s in steps],
            "cp": {k: v for k, v in record.items() if "cp" in k}, "streams": [c.rng.seed for c in trainer.model]}


def expected_cp_bytes(cfg: Any, world: int) -> int:
    """`model.traffic`'s CP bytes of one step: every microbatch through this rank's part of the layers."""
    p, t = cfg.parallel, cfg.train
    microbatches = t.global_batch_size // (t.micro_batch_size * world // (p.tp * p.pp * p.cp))
    per = cp_bytes_per_microbatch(cfg.model, t.micro_batch_size, SEQ, p.cp, p.cp_comm, p.tp,
                                  layers=cfg.model.n_layers // p.pp)
    return microbatches * sum(per.values())


def on_rank(rank: int, world: int, cfgs: list[Any]) -> list[dict[str, Any]]:
    return [train(cfg, world) for cfg in cfgs]


@functools.cache
def launched(world: int) -> list[list[dict[str, Any]]]:
    """Every rank's results of CASES[world], then (world 2) DROPOUT, then LOOSE[world]: one launch."""
    cases = CASES[world] + (DROPOUT if world == 2 else []) + LOOSE.get(world, [])
    return run_ranks(on_rank, world, [config(family, tuple(extra), world) for family, extra in cases], timeout=240)


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_training_equals_one_process(world: int) -> None:
    cfgs = [config(family, tuple(extra), world) for family, extra in CASES[world]]
    ranks = launched(world)
    for i, (family, extra) in enumerate(CASES[world]):
        model = tuple(x for x in extra if x.startswith("model."))
        ref = train(config(family, (*model, "parallel.dp=1"), 1), 1)
        cp, want, op = ranks[0][i]["cp"], expected_cp_bytes(cfgs[i], world), cfgs[i].parallel.cp_comm
        assert cp["bytes_cp"] == want and cp[f"comm/cp/{'ring' if op == 'ring' else 'all_to_all'}/bytes"] == want, cp
        assert op != "ring" or 0 <= cp["comm/overlap_cp"] <= 1, cp  # the hops run behind the blocks' attention
        for r, got in enumerate(ranks):
            for key in ("losses", "norms"):
                label = f"{family} {extra} rank {r} {key}"
                torch.testing.assert_close(got[i][key], ref[key], rtol=1e-5, atol=0,
                                           msg=lambda m, at=label: f"{at}: {m}")


def test_dropout_under_context_parallelism() -> None:
    """With dropout, each CP rank draws its own masks (its TP stream's seed differs from its peer's), training
    differs from the dropout-free run, and selective recomputation reruns the attention with the same masks:
    the same losses and gradient norms to the bit, ring and all-to-all."""
    ranks = launched(2)
    runs = [[r[len(CASES[2]) + i] for r in ranks] for i in range(len(DROPOUT))]
    plain = {"gpt": ranks[0][0]["losses"], "llama": ranks[0][1]["losses"]}
    for (family, extra), (once, again) in zip(DROPOUT[::2], zip(runs[::2], runs[1::2])):
        assert once[0]["streams"] != once[1]["streams"], extra
        assert once[0]["losses"] != plain[family] and all(torch.isfinite(torch.tensor(once[0]["losses"]))), extra
        for key in ("losses", "norms"):
            assert once[0][key] == again[0][key], (extra, key, once[0][key], again[0][key])


@pytest.mark.parametrize("world", sorted(LOOSE))
def test_bf16_runs_follow_one_process_within_bf16_rounding(world: int) -> None:
    ranks = launched(world)
    for i, (family, extra) in enumerate(LOOSE[world]):
        got = ranks[0][len(CASES[world]) + (len(DROPOUT) if world == 2 else 0) + i]
        model = tuple(x for x in extra if not x.startswith(("parallel.", "compression")))
        ref = train(config(family, (*model, "parallel.dp=1"), 1), 1)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-2, atol=0, msg=lambda m, x=extra: f"{x}: {m}")
        assert got["losses"][-1] < got["losses"][0], got["losses"]
