"""Whole models under tensor (and sequence) parallelism against the single-process run.

Reference: the same config trained by one process (tp=1, dp=1, the global batch as
microbatches). Every layout trains the same model from the same initial weights on the same
samples, so losses, reported gradient norms and the (gathered) weights after two AdamW steps
(the second moved by the first's moments) must agree to fp32 round-off: rtol = atol = 1e-5 on
losses, 1e-4 / 1e-5 on weights.
Clipping is set low (`optim.grad_clip=0.05`) so it acts on every step: a gradient norm
that double-counted TP-replicated parameters would change every update.

Byte counts are read from `collectives.COUNTER` and compared with `hybrid.model.traffic`,
whose per-layer figure is Megatron's: four all-reduces of b·s·h per layer and microbatch,
or, with sequence parallelism, the same ring volume as all-gathers + reduce-scatters (plus
Megatron's backward re-gathers, counted under their own op).

One launch per world size trains every run of that size one after another (a fresh model and
Trainer each; the groups built once per layout), and the tests read its results (`launched`):
  - world 2 (tp2): GPT and Llama with and without SP (against the single process and the
    analytic bytes), GPT with dropout and under bf16 autocast, and the one-forward probes
    (dropout streams, saved activations);
  - world 4: tp4 and tp2dp2, GPT and Llama, with and without SP;
  - world 8: tp8 GPT (8 heads), with and without SP.
Every config is composed in the test process before the ranks fork (`compose_config`'s memo), its heap
frozen while they run (`run_frozen`), and each single-process reference is trained once (`reference`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import pytest
import torch
from test_dp import GLOBAL_BATCH, SEQ, synthetic_corpus, tiny_cfg
from tp_helpers import run_frozen

from hybrid.compression.hooks import make_hook
from hybrid.model import build_model
from hybrid.model.traffic import tp_bytes_per_microbatch, tp_bytes_per_step
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.params import full_state_dict, param_info
from hybrid.testing.activations import saved_tally
from hybrid.trainer import Trainer

VOCAB = 201  # with make_vocab_size_divisible_by=1: padded to 202 (tp=2) and 204 (tp=4), not divisible by tp
STEPS = 2  # the second step's loss and norm, and the final weights, already depend on the first update
TIMEOUT = 300


@dataclass(frozen=True)
class Run:
    """One training run on a launch's ranks (dp = world / tp): the model family, the layout and what
    differs from the plain fp32 run."""

    family: str = "gpt"
    tp: int = 1
    sp: bool = False
    dropout: float = 0.0
    kv_heads: int = 2
    heads: int = 4
    precision: str = "fp32"

    def single(self) -> Run:
        """The same model trained by one process (tp=1, no SP)."""
        return replace(self, tp=1, sp=False)


def model_cfg(family: str, tp: int, dp: int, micro: int, sp: bool, dropout: float = 0.0, kv_heads: int = 2,
              heads: int = 4) -> Any:
    cfg = tiny_cfg(family, dp, micro)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sp
    cfg.model.make_vocab_size_divisible_by = 1
    cfg.model.dropout = dropout
    cfg.optim.grad_clip = 0.05
    cfg.model.n_heads = heads
    if family == "llama":
        cfg.model.n_heads, cfg.model.n_kv_heads = 8, kv_heads  # GQA: KV heads < heads, split across TP
    return cfg


def run_cfg(run: Run, world: int) -> Any:
    """The config of `run` on `world` ranks: the global batch of 8 as 2 microbatches per DP rank
    (one process: 4 microbatches of 2)."""
    dp = world // run.tp
    cfg = model_cfg(run.family, run.tp, dp, GLOBAL_BATCH // dp // 2 if world > 1 else 2, run.sp, run.dropout,
                    run.kv_heads, run.heads)
    cfg.train.precision, cfg.train.steps = run.precision, STEPS
    return cfg


def train(ctx: ParallelContext, run: Run) -> dict:
    """Train STEPS steps; return losses, grad norms, the gathered weights (TP rank 0 of DP rank 0),
    this rank's replicated parameters and the TP bytes counted per step."""
    cfg = run_cfg(run, ctx.layout.world)
    torch.manual_seed(cfg.train.seed)  # as hybrid.train does: the same default stream on every rank
    corpus = synthetic_corpus(vocab=VOCAB)
    model = build_model(cfg.model, VOCAB, ctx.tp_group, seed=cfg.train.seed, sequence_parallel=run.sp)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, model, corpus, torch.device("cpu"), hook, state)
    losses, norms, step_bytes = [], [], []
    for _ in range(cfg.train.steps):
        C.COUNTER.reset()
        r = trainer.train_step()
        losses.append(r.loss)
        norms.append(r.grad_norm)
        step_bytes.append({op: b for (g, op), b in C.COUNTER.bytes.items() if g == "tp"})
    full = full_state_dict(model, ctx.tp_group)
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if param_info(p).tp_duplicate}
    return {"losses": losses, "norms": norms, "state": full if ctx.rank == 0 else None, "replicated": replicated,
            "bytes": step_bytes, "microbatches": trainer.num_microbatches, "micro": cfg.train.micro_batch_size}


def assert_same_weights(ours: dict, ref: dict) -> None:
    for name, w in ref.items():
        mine = ours[name]
        if name in ("tok_embed.weight", "head.weight"):  # padded rows differ in count between layouts
            mine, w = mine[:VOCAB], w[:VOCAB]
        torch.testing.assert_close(mine, w, rtol=1e-4, atol=1e-5, msg=name)


def dropout_streams(ctx: ParallelContext, sp: bool) -> dict[str, list[int]]:
    """Fingerprints of the default generator's state at every residual dropout and every
    attention call of one training forward: equal fingerprints = equal masks."""
    cfg = model_cfg("gpt", ctx.layout.world, 1, 2, sp, dropout=0.1)
    torch.manual_seed(cfg.train.seed)  # as hybrid.train does: the same default stream on every rank
    model = build_model(cfg.model, VOCAB, ctx.tp_group, seed=0, sequence_parallel=sp).train()
    seen: dict[str, list[int]] = {"residual": [], "attention": []}

    def fingerprint() -> int:
        return hash(torch.default_generator.get_state().numpy().tobytes())

    for block in model.layers.values():
        block.dropout.register_forward_pre_hook(lambda *_: seen["residual"].append(fingerprint()))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        seen["attention"].append(fingerprint())
        return sdpa(*args, **kwargs)

    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa):
        model(ids[:, :-1], ids[:, 1:]).backward()
    return seen


def saved_activation_bytes(ctx: ParallelContext, sp: bool) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded)."""
    cfg = model_cfg("gpt", ctx.layout.world, 1, 2, sp)
    model = build_model(cfg.model, VOCAB, ctx.tp_group, seed=0, sequence_parallel=sp)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with saved_tally(model) as seen:  # the shared tally (hybrid.testing): unique storages saved for backward
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return sum(n for _, n in seen.values())


# ---- the launches ---------------------------------------------------------------------------------------------

LAYOUTS = [(2, 2, False), (2, 2, True), (4, 4, False), (4, 4, True), (4, 2, False), (4, 2, True)]  # world, tp, sp
FAMILIES = ["gpt", "llama"]
SPS = [False, True]


def matched(family: str, tp: int, sp: bool) -> Run:
    """The run held to the single process: Llama's 8 heads with 4 KV heads at tp4 (one per rank), else 2."""
    return Run(family, tp, sp, kv_heads=4 if tp == 4 and family == "llama" else 2)


def tp8(sp: bool) -> Run:
    return Run("gpt", 8, sp, heads=8)


def dropped(sp: bool) -> Run:
    return Run("gpt", 2, sp, dropout=0.2)


def bf16(sp: bool) -> Run:
    return Run("gpt", 2, sp, precision="bf16")


# world → the runs of its launch; world 2 also runs the one-forward probes at tp2 (with and without SP)
LAUNCHES: dict[int, list[Run]] = {
    2: [matched(f, tp, sp) for w, tp, sp in LAYOUTS if w == 2 for f in FAMILIES]
       + [dropped(sp) for sp in SPS] + [bf16(sp) for sp in SPS],
    4: [matched(f, tp, sp) for w, tp, sp in LAYOUTS if w == 4 for f in FAMILIES],
    8: [tp8(sp) for sp in SPS],
}


def launch_runs(rank: int, world: int, runs: list[Run], probes: bool) -> dict[str, Any]:
    """Rank function: train each run in turn (the groups built once per TP size); with `probes`, the dropout
    streams and the saved activation bytes of one forward at tp=world, without and with SP."""
    contexts: dict[int, ParallelContext] = {}
    out: dict[str, Any] = {"runs": []}
    for run in runs:
        if run.tp not in contexts:
            contexts[run.tp] = ParallelContext.build(Layout.create(world, tp=run.tp))
        out["runs"].append(train(contexts[run.tp], run))
    if probes:
        ctx = contexts.get(world) or ParallelContext.build(Layout.create(world, tp=world))
        out["streams"] = {sp: dropout_streams(ctx, sp) for sp in SPS}
        out["saved"] = {sp: saved_activation_bytes(ctx, sp) for sp in SPS}
    return out


@functools.cache
def launched(world: int) -> list[dict[str, Any]]:
    """The launch of `world` ranks (once per session), by rank: its runs' results by `Run`, and the probes."""
    torch.set_num_threads(1)
    runs = LAUNCHES[world]
    for run in runs:  # composed here once, inherited by the forked ranks (compose_config's memo)
        run_cfg(run, world)
    probes = world == 2
    if probes:
        for sp in SPS:
            model_cfg("gpt", world, 1, 2, sp)
    results = run_frozen(launch_runs, world, runs, probes, timeout=TIMEOUT)
    return [r | {"runs": dict(zip(runs, r["runs"]))} for r in results]


def results_of(world: int, run: Run) -> list[dict[str, Any]]:
    """Every rank's results of `run` in the launch of `world` ranks."""
    return [r["runs"][run] for r in launched(world)]


@functools.cache
def reference(run: Run) -> dict[str, Any]:
    """`run` trained by the test process alone (tp = dp = 1, the global batch as 4 microbatches of 2)."""
    torch.set_num_threads(1)
    return train(ParallelContext.single(), run.single())


# ---- the tests ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,tp,sp", LAYOUTS, ids=lambda v: str(v))
def test_tp_matches_single_process(family: str, world: int, tp: int, sp: bool) -> None:
    run = matched(family, tp, sp)
    ref = reference(run)
    assert ref["losses"][-1] < ref["losses"][0]
    results = results_of(world, run)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
    assert_same_weights(results[0]["state"], ref["state"])
    for r in results[1:tp]:  # replicated parameters (norms, biases, positions) stay identical over TP
        for name, w in results[0]["replicated"].items():
            torch.testing.assert_close(r["replicated"][name], w, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("sp", SPS)
def test_tp8_gpt_matches_single_process(sp: bool) -> None:
    ref = reference(tp8(sp))
    results = results_of(8, tp8(sp))
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    assert_same_weights(results[0]["state"], ref["state"])


@pytest.mark.parametrize("sp", SPS)
def test_dropout_under_tp(sp: bool) -> None:
    """With dropout, TP ranks must still agree on every replicated parameter (same masks on
    replicated activations), and training must differ from the dropout-free run."""
    results = results_of(2, dropped(sp))
    plain = results_of(2, matched("gpt", 2, sp))
    assert results[0]["losses"] != plain[0]["losses"]
    for name, w in results[0]["replicated"].items():
        torch.testing.assert_close(results[1]["replicated"][name], w, rtol=0, atol=0, msg=name)


def expected_step_bytes(family: str, tp: int, sp: bool, micro: int, microbatches: int,
                        itemsize: int = 4) -> dict[str, int]:
    return tp_bytes_per_step(model_cfg(family, tp, 1, micro, sp).model, micro, SEQ, tp, sp, microbatches, itemsize)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_bytes_equal_the_analytic_figure(family: str) -> None:
    counted = {}
    for sp in SPS:
        r = results_of(2, matched(family, 2, sp))[0]
        expected = expected_step_bytes(family, 2, sp, r["micro"], r["microbatches"])
        for step in r["bytes"]:
            assert step == expected, (sp, step, expected)
        counted[sp] = r["bytes"][0]
    # Per layer and microbatch: 4 all-reduces of b·s·h, or 4 all-gathers + 4 reduce-scatters
    # (+ 2 re-gathers) of b·s·h under SP — the same ring volume for the TP exchange itself.
    cfg = model_cfg(family, 2, 1, 2, False)
    one = tp_bytes_per_microbatch(cfg.model, 2, SEQ, 2, False, layers=1, pre=False, post=False)
    two = tp_bytes_per_microbatch(cfg.model, 2, SEQ, 2, True, layers=1, pre=False, post=False)
    bsh = 2 * SEQ * cfg.model.hidden * 4
    assert one == {"all_reduce": 4 * bsh}
    assert two == {"all_gather": 4 * bsh, "reduce_scatter": 4 * bsh, "regather": 2 * bsh}
    assert 2 * (2 - 1) / 2 * one["all_reduce"] == (2 - 1) / 2 * (two["all_gather"] + two["reduce_scatter"])
    assert counted[True]["reduce_scatter"] == counted[True]["all_gather"]


@pytest.mark.parametrize("sp", SPS)
def test_bf16_autocast_exchanges_bf16_and_tracks_the_single_process_run(sp: bool) -> None:
    """Under CPU bf16 autocast the TP exchanges run in bf16 (itemsize 2 in the analytic figure, the
    embedding and the loss's reductions in fp32), and the losses follow tp=1 autocast within bf16
    round-off (the two layouts round partial sums differently)."""
    ref = reference(bf16(sp))
    r = results_of(2, bf16(sp))[0]
    expected = expected_step_bytes("gpt", 2, sp, r["micro"], r["microbatches"], itemsize=2)
    assert r["bytes"][0] == expected, (r["bytes"][0], expected)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sp", SPS)
def test_dropout_masks_follow_the_tp_layout(sp: bool) -> None:
    """Attention dropout (this rank's heads) draws from each TP rank's own stream; residual
    dropout draws the same masks on every TP rank without SP (replicated activations) and
    different masks with SP (each rank's own sequence chunk)."""
    a, b = (r["streams"][sp] for r in launched(2))
    assert len(a["attention"]) == len(a["residual"]) // 2 == 2  # 2 layers; 2 residual dropouts each
    assert all(x != y for x, y in zip(a["attention"], b["attention"]))
    if sp:
        assert all(x != y for x, y in zip(a["residual"], b["residual"]))
    else:
        assert a["residual"] == b["residual"]


def test_sequence_parallel_saves_less_activation_memory() -> None:
    saved = launched(2)[0]["saved"]
    assert saved[True] < saved[False], (saved[True], saved[False])
