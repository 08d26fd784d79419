"""Data parallelism on gloo ranks against references: a single process, and torch's own DDP.

The rank work runs in one launch per world size (2, 4 and 8 ranks, each once per session: `launched`), with
every config composed in the test process before the ranks fork; the single-process references run there too.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  (AdamW imports it lazily, ~3 CPU-s: once here, not in every forked rank)
import torch.distributed as dist
from harness import run_ranks

from hybrid.compression.hooks import allreduce_hook, make_hook
from hybrid.config import compose_config
from hybrid.data import Corpus
from hybrid.model import build_model
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.data import GradSync
from hybrid.trainer import Trainer

SEQ = 16
GLOBAL_BATCH = 8


def tiny_cfg(family: str, dp: int, micro_batch: int, bucket_mb: float = 0.02) -> object:
    model = "gpt-tiny" if family == "gpt" else "llama-tiny"
    return compose_config([
        f"model={model}", "model.n_layers=2", "model.hidden=64", "model.n_heads=4", "model.max_seq_len=32",
        "model.ffn_hidden=128", f"data.seq_len={SEQ}", f"train.global_batch_size={GLOBAL_BATCH}",
        f"train.micro_batch_size={micro_batch}", "train.steps=4", "train.eval_every=0", "train.lr=3e-3",
        "optim.warmup_steps=1", f"parallel.bucket_mb={bucket_mb}", f"parallel.dp={dp}", "parallel.name=test",
    ])


def synthetic_corpus(vocab: int = 200, n: int = 64, seq: int = SEQ) -> Corpus:
    """Token streams with structure (arithmetic runs) so the loss can fall."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, vocab, size=(n, 1))
    steps = rng.integers(1, 4, size=(n, 1))
    samples = ((starts + steps * np.arange(seq + 1)) % vocab).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=vocab, eos_id=0, train=samples[:-8], eval=samples[-8:], seq_len=seq)


def train_losses(rank: int, world: int, family: str, micro_batch: int, tp: int = 1) -> dict:
    cfg = tiny_cfg(family, world // tp, micro_batch)
    cfg.parallel.tp = tp
    ctx = ParallelContext.build(Layout.create(world, tp=tp)) if world > 1 else ParallelContext.single()
    corpus = synthetic_corpus()
    model = build_model(cfg.model, corpus.vocab_size, ctx.tp_group, seed=cfg.train.seed)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, model, corpus, torch.device("cpu"), hook, state)
    losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
    out = {"losses": losses, "launch_log": trainer.grad_sync.last_launch_log,
           "buckets": len(trainer.grad_sync.buckets)}
    if rank == 0:
        out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@functools.cache
def reference(family: str) -> dict:
    """The single process: 4 microbatches of 2 = the global batch of 8."""
    torch.set_num_threads(1)
    return train_losses(0, 1, family, micro_batch=2)


def run_jobs(rank: int, world: int, jobs: dict[str, tuple]) -> dict[str, object]:
    """Rank function: each job `name: (fn, args)` in turn, `fn(rank, world, *args)` → its result by name."""
    return {name: fn(rank, world, *args) for name, (fn, args) in jobs.items()}


def jobs(world: int) -> dict[str, tuple]:
    """What the launch on `world` ranks runs: DP (micro batch 2, or 1 at dp=4), TP at tp=2 (with DP on 4 ranks),
    DP with one microbatch per rank (the launch log), torch's DDP beside our GradSync; on 8: the groups."""
    if world == 8:
        return {"groups": (groups_check, GROUPS_LAYOUT)}
    out: dict[str, tuple] = {}
    for family in ("gpt", "llama"):
        out[f"dp-{family}"] = (train_losses, (family, 2 if world == 2 else 1, 1))
        out[f"tp2-{family}"] = (train_losses, (family, 2, 2))
    if world == 2:
        out["one-microbatch"] = (train_losses, ("gpt", 4, 1))
        out["ddp"] = (grads_vs_ddp, ())
    return out


@functools.cache
def launched(world: int) -> dict[str, list]:
    """job name → its results by rank, from the one launch on `world` ranks (configs composed here first)."""
    torch.set_num_threads(1)
    for fn, args in jobs(world).values():
        if fn is train_losses:
            family, micro, tp = args
            tiny_cfg(family, world // tp, micro)
        elif fn is grads_vs_ddp:
            tiny_cfg("gpt", world, 2, bucket_mb=0.05)
    results = run_ranks(run_jobs, world, jobs(world), timeout=120)
    return {name: [r[name] for r in results] for name in jobs(world)}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_dp_matches_single_process(family: str) -> None:
    ref = reference(family)
    assert ref["losses"][-1] < ref["losses"][0]
    for world in (2, 4):  # dp=2 with micro batch 2, dp=4 with 1
        results = launched(world)[f"dp-{family}"]
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
        for name, w in ref["state"].items():
            torch.testing.assert_close(results[0]["state"][name], w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tp2_and_tp2dp2_match_single_process(family: str) -> None:
    """The TP layers (covered in full by tests/dist/test_tp*.py) already train like one process."""
    ref = reference(family)
    for world in (2, 4):
        for r in launched(world)[f"tp2-{family}"]:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)


def test_first_bucket_launches_inside_backward() -> None:
    results = launched(2)["one-microbatch"]
    log = results[0]["launch_log"]
    assert results[0]["buckets"] > 2
    assert [i for i, _ in log] == list(range(results[0]["buckets"]))  # every bucket, in index order
    assert log[0][1], "bucket 0's hook should be launched while autograd is still running"


def grads_vs_ddp(rank: int, world: int) -> dict:
    cfg = tiny_cfg("gpt", world, 2, bucket_mb=0.05)
    ctx = ParallelContext.build(Layout.create(world, dp=world))
    model = build_model(cfg.model, 200, None, seed=1)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.dp_group)
    sync = GradSync(list(model.parameters()), ctx.dp_group, allreduce_hook, ctx.dp_group, bucket_mb=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    ids = torch.randint(0, 200, (2, SEQ + 1), generator=g)
    sync.begin_step(1)
    model(ids[:, :-1], ids[:, 1:]).backward()
    sync.finish()
    ddp(ids[:, :-1], ids[:, 1:]).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    theirs = {n.removeprefix("module."): p.grad.clone() for n, p in ddp.named_parameters()}
    return {"ours": ours, "theirs": theirs}


def test_gradsync_equals_torch_ddp() -> None:
    results = launched(2)["ddp"]
    for r in results:
        for name, g in r["theirs"].items():
            torch.testing.assert_close(r["ours"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    for name in results[0]["ours"]:  # synced: identical on every rank
        torch.testing.assert_close(results[0]["ours"][name], results[1]["ours"][name], rtol=0, atol=0)


GROUPS_LAYOUT = (2, 2, 4)  # tp, pp, ranks per node on 8 ranks


def groups_check(rank: int, world: int, tp: int, pp: int, rpn: int) -> dict:
    layout = Layout.create(world, tp=tp, pp=pp, ranks_per_node=rpn)
    ctx = ParallelContext.build(layout)
    out = {}
    for name in ("tp", "dp", "pp", "dp_intra", "dp_inter", "embedding"):
        group = getattr(ctx, f"{name}_group")
        out[name] = dist.get_process_group_ranks(group)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[name + "_sum"] = t.item()
    return out


def test_real_groups_on_8_ranks() -> None:
    tp, pp, rpn = GROUPS_LAYOUT
    layout = Layout.create(8, tp=tp, pp=pp, ranks_per_node=rpn)
    results = launched(8)["groups"]
    expected = {"tp": layout.tp_groups(), "dp": layout.dp_groups(), "pp": layout.pp_groups(),
                "dp_intra": layout.dp_intra_node_groups(), "dp_inter": layout.dp_inter_node_groups(),
                "embedding": layout.embedding_groups()}
    for rank, r in enumerate(results):
        for name, groups in expected.items():
            mine = next(g for g in groups if rank in g)
            assert sorted(r[name]) == sorted(mine), (rank, name)
            assert r[name + "_sum"] == float(sum(mine))  # a real collective over exactly those ranks
