"""transformers conversion under tensor parallelism (hybrid.model.hf on gloo TP ranks).

Reference: transformers' GPT2LMHeadModel / LlamaForCausalLM with random weights (norms and
biases too), fp64, eager attention, built in the parent process; each TP rank loads them with
`load_hf_into` (its own slice of every sharded parameter) and compares, with and without
sequence parallelism:
- `full_logits` against transformers' logits, the mean loss against transformers' loss, and
  every local gradient against this rank's slice of transformers' gradient;
- `export_hf_state_dict` (all-gather of the TP shards) against the original transformers state
  dict, bit for bit, and loadable with `load_state_dict(strict=True)`;
- after two AdamW steps at tp=2 (sequence parallel), the exported transformers model's logits
  against our `full_logits`;
- a pipeline stage's export raises a ValueError naming what it lacks.

Tolerances are those of tests/unit/test_models.py (GPT fp64 logits 1e-10; Llama 1e-5 because
both sides build fp32 RoPE tables with different roundings; fp32 losses atol 1e-7 / rtol 1e-6;
Llama gradients 1e-5), except GPT gradients: atol 1e-8 (unit: 1e-9), rtol 1e-6. At tp>1 our loss
is the vocab-parallel cross-entropy, whose fp32 softmax rounds differently from transformers'
`F.cross_entropy` (at tp=1 both run the same kernel), so every gradient carries errors of ~1e-8
of the largest gradient (at the unit test's 1e-9 that reaches 0.94 of the tolerance: too close).
Measured maximum absolute errors (tp=2 and 4, with and without SP, every rank): GPT logits
1.7e-15, Llama logits 1.9e-7; losses 9.5e-7 (GPT) and 1.4e-6 (Llama; losses of ~5.6, so 2 and 3 fp32 ulps);
gradients GPT 3.4e-9, Llama 2.7e-8; logits after training and export GPT 1.1e-15, Llama 2.4e-7.
Exports are bit-identical.

Ranks compare locally and send back small summaries (max errors, failure messages, digests).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks

from hybrid.config import ModelConfig
from hybrid.model import build_model
from hybrid.model.hf import export_hf_state_dict, from_hf_state_dict, hf_config, load_hf_into
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.grads import sync_sequence_parallel_grads
from hybrid.parallel.params import param_info
from hybrid.parallel.tp.tensor import padded_vocab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_models import GRAD_TOL, LOGITS_TOL, LOSS_TOL, hf_class, hf_model, ids_for, small_cfg  # noqa: E402

# (id, config overrides, vocab, TP sizes). 300 pads to 384 (tp=2) / 512 (tp=4); 256 pads to 512 at tp=4.
CASES = [
    ("gpt-tied-pad", {"family": "gpt"}, 300, (2, 4)),
    ("llama-gqa-untied-pad", {"family": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "tie_embeddings": False},
     300, (2,)),
    ("gpt-untied", {"family": "gpt", "tie_embeddings": False}, 256, (4,)),
    ("llama-tied", {"family": "llama", "ffn_hidden": 96, "rope_theta": 500000.0}, 256, (4,)),
]
SEQ = 16  # divisible by every tp
TP_GRAD_TOL = GRAD_TOL | {"gpt": {"atol": 1e-8, "rtol": 1e-6}}  # fp32 vocab-parallel cross-entropy (docstring)


@dataclass
class Reference:
    """One case's transformers model outputs, computed once in the parent process."""

    name: str
    cfg: ModelConfig
    vocab: int
    hf_state: dict[str, torch.Tensor]
    ids: torch.Tensor  # [2, SEQ + 1]
    logits: torch.Tensor  # [2, SEQ, vocab]: transformers' logits of ids[:, :SEQ]
    loss: torch.Tensor  # transformers' next-token loss of ids
    grads: dict[str, torch.Tensor]  # our global names, vocabulary padded for tp


def reference(name: str, overrides: dict, vocab: int, tp: int) -> Reference:
    cfg = small_cfg(**overrides)
    theirs = hf_model(cfg, vocab)
    ids = ids_for(vocab, s=SEQ + 1)
    out = theirs(ids, labels=ids)
    out.loss.backward()
    # keep_vars: the Parameters themselves, so a tied lm_head/wte pair shares one .grad
    grads = from_hf_state_dict({k: v.grad for k, v in theirs.state_dict(keep_vars=True).items()}, cfg, vocab, tp)
    return Reference(name, cfg, vocab, {k: v.detach().clone() for k, v in theirs.state_dict().items()}, ids,
                     out.logits[:, :SEQ].detach(), out.loss.detach(), grads)


def tp_model(ref: Reference, group: Any, sp: bool) -> torch.nn.Module:
    model = build_model(ref.cfg, ref.vocab, group, seed=11, sequence_parallel=sp).double()
    load_hf_into(model, ref.hf_state, ref.cfg, ref.vocab)
    return model


def compare(got: torch.Tensor, expected: torch.Tensor, what: str, **tol: float) -> dict[str, Any]:
    """{"err": max |got - expected|, "fail": assert_close's message or ""}: small enough to send back."""
    err = (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else float("inf")
    try:
        torch.testing.assert_close(got, expected, **tol)
        return {"err": err, "fail": ""}
    except AssertionError as e:
        return {"err": err, "fail": f"{what}: {str(e)[:400]}"}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    fails = "\n".join(r["fail"] for r in results if r["fail"])
    return {"err": max((r["err"] for r in results), default=0.0), "fail": fails}


def compare_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-exact comparison of two state dicts, plus a digest for comparing across ranks."""
    if sorted(got) != sorted(expected):
        return {"err": float("inf"), "fail": f"keys differ: {sorted(set(got) ^ set(expected))}", "digest": ""}
    out = merge([compare(got[k], t, k, atol=0, rtol=0) for k, t in expected.items()])
    digest = hashlib.sha256()
    for k in sorted(got):
        digest.update(k.encode() + got[k].contiguous().numpy().tobytes())
    return out | {"digest": digest.hexdigest()}


def into_hf(state: dict[str, torch.Tensor], ref: Reference) -> torch.nn.Module:
    """A fresh transformers model loaded with `state` (strict); a tied head stays tied."""
    theirs = hf_class(ref.cfg)(hf_config(ref.cfg, ref.vocab, attn_implementation="eager")).double().eval()
    theirs.load_state_dict(state, strict=True)
    if ref.cfg.tie_embeddings:
        assert theirs.lm_head.weight is theirs.get_input_embeddings().weight
    return theirs


def check_case(ref: Reference, group: Any, sp: bool) -> dict[str, Any]:
    """Logits, loss and local gradients (against this rank's slice of transformers' gradients);
    the export against the original state dict, loaded strictly into a fresh transformers model."""
    model = tp_model(ref, group, sp).eval()
    logits = model.full_logits(ref.ids[:, :SEQ]).detach()
    loss = model(ref.ids[:, :SEQ], labels=ref.ids[:, 1:])
    loss.backward()
    sync_sequence_parallel_grads(list(model.parameters()), group)
    grads = []
    for name, p in model.named_parameters():
        shard = param_info(p).shard
        expected = shard.slice(ref.grads[name]) if shard is not None else ref.grads[name]
        grads.append(compare(p.grad, expected, f"grad {name}", **TP_GRAD_TOL[ref.cfg.family]))
    export = export_hf_state_dict(model, ref.cfg, ref.vocab)
    try:
        into_hf(export, ref)
        loads = ""
    except (RuntimeError, AssertionError) as e:
        loads = f"strict load into transformers: {str(e)[:400]}"
    return {"loads": loads, "logits": compare(logits, ref.logits, "logits", **LOGITS_TOL[ref.cfg.family]),
            "loss": compare(loss.detach(), ref.loss, "loss", **LOSS_TOL), "grads": merge(grads),
            "grad_names": sorted(n for n, _ in model.named_parameters()),
            "export": compare_state(export, ref.hf_state)}


def train_then_export(ref: Reference, group: Any, steps: int = 2) -> dict[str, Any]:
    """A few AdamW steps (sequence parallel); then the exported transformers model's logits of a
    probe batch against our `full_logits`."""
    model = tp_model(ref, group, sp=True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)  # the same batches on every TP rank
    for _ in range(steps):
        ids = torch.randint(0, ref.vocab, (2, SEQ + 1), generator=gen)
        opt.zero_grad()
        model(ids[:, :SEQ], labels=ids[:, 1:]).backward()
        sync_sequence_parallel_grads(list(model.parameters()), group)
        opt.step()
    probe = torch.randint(0, ref.vocab, (2, SEQ), generator=gen)
    model.eval()
    ours = model.full_logits(probe).detach()
    export = export_hf_state_dict(model, ref.cfg, ref.vocab)
    try:
        with torch.no_grad():
            theirs = into_hf(export, ref)(probe).logits
        logits = compare(ours, theirs, "logits after training", **LOGITS_TOL[ref.cfg.family])
    except (RuntimeError, AssertionError) as e:
        logits = {"err": float("inf"), "fail": f"strict load into transformers: {str(e)[:400]}"}
    return {"logits": logits,
            "moved": not torch.equal(export["lm_head.weight"], ref.hf_state["lm_head.weight"]),
            "digest": compare_state(export, export)["digest"]}


def stage_export_errors(ref: Reference, group: Any) -> dict[str, str]:
    """Export of a first and a last pipeline stage (tp-sharded): the ValueError messages."""
    stages = {"first": {"layers": range(0, 1), "pre": True, "post": False},
              "last": {"layers": range(1, 2), "pre": False, "post": True}}
    errors = {}
    for what, kw in stages.items():
        stage = build_model(ref.cfg, ref.vocab, group, **kw).double()
        load_hf_into(stage, ref.hf_state, ref.cfg, ref.vocab)
        try:
            export_hf_state_dict(stage, ref.cfg, ref.vocab)
            errors[what] = "no error"
        except ValueError as e:
            errors[what] = str(e)
    return errors


def tp_worker(rank: int, world: int, refs: list[Reference], train: bool) -> dict[Any, Any]:
    ctx = ParallelContext.build(Layout.create(world, tp=world))
    out: dict[Any, Any] = {}
    for ref in refs:
        for sp in (False, True):
            out[ref.name, sp] = check_case(ref, ctx.tp_group, sp)
        if train:
            out[ref.name, "train"] = train_then_export(ref, ctx.tp_group)
    if train:
        out["stage_errors"] = stage_export_errors(refs[0], ctx.tp_group)
    return out


@functools.cache
def launch(tp: int) -> tuple[dict[str, Reference], list[dict[Any, Any]]]:
    """One gloo launch per TP size: every case of that size, with and without SP (training at tp=2)."""
    torch.set_num_threads(1)
    refs = {name: reference(name, ov, vocab, tp) for name, ov, vocab, tps in CASES if tp in tps}
    return refs, run_ranks(tp_worker, tp, list(refs.values()), tp == 2, timeout=120)


TP_CASES = [(tp, c[0]) for c in CASES for tp in c[3]]
TP_IDS = [f"tp{tp}-{name}" for tp, name in TP_CASES]


@pytest.mark.parametrize("tp,name", TP_CASES, ids=TP_IDS)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_logits_loss_grads_match_transformers(tp: int, name: str, sp: bool) -> None:
    refs, results = launch(tp)
    for rank, res in enumerate(results):
        r = res[name, sp]
        assert r["grad_names"] == sorted(refs[name].grads)
        for what in ("logits", "loss", "grads"):
            assert not r[what]["fail"], f"rank {rank}: {r[what]['fail']}"


@pytest.mark.parametrize("tp,name", TP_CASES, ids=TP_IDS)
def test_export_round_trip_is_exact(tp: int, name: str) -> None:
    """Every rank's export (with and without SP) is the original transformers state dict, bit for bit,
    and loads strictly into a fresh transformers model (checked on the ranks)."""
    refs, results = launch(tp)
    assert refs[name].grads["tok_embed.weight"].shape[0] == padded_vocab(refs[name].vocab, 128, tp)
    for rank, res in enumerate(results):
        for sp in (False, True):
            export = res[name, sp]["export"]
            assert not export["fail"] and export["err"] == 0, f"rank {rank} sp={sp}: {export['fail']}"
            assert not res[name, sp]["loads"], f"rank {rank} sp={sp}: {res[name, sp]['loads']}"


@pytest.mark.parametrize("name", [c[0] for c in CASES if 2 in c[3]])
def test_train_then_export_matches(name: str) -> None:
    """After AdamW steps at tp=2 the exported transformers model computes our logits; every rank
    exports the same state dict (replicated parameters stayed in sync)."""
    _, results = launch(2)
    trained = [res[name, "train"] for res in results]
    assert all(t["moved"] for t in trained)
    assert len({t["digest"] for t in trained}) == 1
    for rank, t in enumerate(trained):
        assert not t["logits"]["fail"], f"rank {rank}: {t['logits']['fail']}"


def test_pipeline_stage_export_raises() -> None:
    """A stage lacks layers and embedding or head: a clear error on every TP rank, before any collective."""
    refs, results = launch(2)
    for res in results:
        first, last = res["stage_errors"]["first"], res["stage_errors"]["last"]
        assert "needs the whole model" in first and "layers 1..1" in first and "norm.weight" in first
        assert "needs the whole model" in last and "layers 0..0" in last and "tok_embed.weight" in last
    ref = refs["gpt-tied-pad"]
    stage = build_model(ref.cfg, ref.vocab, layers=range(0, 2), pre=False, post=True)  # tp=1, no embeddings
    with pytest.raises(ValueError, match=r"lacks tok_embed\.weight; pos_embed\.weight"):
        export_hf_state_dict(stage, ref.cfg, ref.vocab)

