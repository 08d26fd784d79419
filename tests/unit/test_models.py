"""Our GPT / Llama against transformers' GPT2LMHeadModel / LlamaForCausalLM (hybrid.model.hf).

Reference: transformers with the same weights (eager attention, fp64). Tolerances:
- GPT logits: fp64 end to end, atol = rtol = 1e-10.
- Llama logits: both sides build RoPE cos/sin at fp32 precision (ours in fp64 rounded to fp32,
  transformers in fp32), with different roundings, so atol = rtol = 1e-5.
- Losses: both sides compute the cross-entropy on logits cast to fp32 (`.float()`), so the loss
  is an fp32 number: atol = 1e-7, rtol = 1e-6.
- Gradients: GPT atol = 1e-9, rtol = 1e-6 (fp32 cross-entropy, measured ~1e-15 relative);
  Llama atol = rtol = 1e-5 (the fp32 RoPE tables again; measured ~3e-7 relative).
Conversions themselves are exact (bit-identical round trips).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from hybrid.config import ModelConfig
from hybrid.model import analytic_param_count, build_model, family_of
from hybrid.model.hf import conversion_rules, from_hf_state_dict, hf_config, load_hf_into, to_hf_state_dict
from hybrid.parallel.params import Init, Shard, annotate
from hybrid.parallel.tp.tensor import padded_vocab

LOGITS_TOL = {"gpt": {"atol": 1e-10, "rtol": 1e-10}, "llama": {"atol": 1e-5, "rtol": 1e-5}}
LOSS_TOL = {"atol": 1e-7, "rtol": 1e-6}
GRAD_TOL = {"gpt": {"atol": 1e-9, "rtol": 1e-6}, "llama": {"atol": 1e-5, "rtol": 1e-5}}

# (id, config overrides, vocab): 300 is padded to 384; 256 is already a multiple of 128.
CASES = [
    ("gpt-tied-pad", {"family": "gpt"}, 300),
    ("gpt-untied-nopad", {"family": "gpt", "tie_embeddings": False}, 256),
    ("llama-gqa-untied-pad", {"family": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "tie_embeddings": False}, 300),
    ("llama-tied-nopad", {"family": "llama", "ffn_hidden": 96, "rope_theta": 500000.0}, 256),
]


def hf_class(cfg: ModelConfig) -> type:
    """transformers' LM class of `cfg`'s family (GPT2LMHeadModel, LlamaForCausalLM: its HFCounterpart)."""
    return getattr(transformers, family_of(cfg).hf.lm_class)


def small_cfg(**overrides: object) -> ModelConfig:
    base = {"n_layers": 2, "hidden": 64, "n_heads": 4, "max_seq_len": 32, "norm_eps": 1e-5}
    return ModelConfig(**(base | overrides))


def hf_model(cfg: ModelConfig, vocab: int, seed: int = 0) -> torch.nn.Module:
    """A transformers LM of `cfg`'s shape with random weights (norms and biases too), fp64, eval."""
    torch.manual_seed(seed)
    cls = hf_class(cfg)
    model = cls(hf_config(cfg, vocab, attn_implementation="eager")).double().eval()
    randomize(model)
    return model


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Every parameter random, so a swapped bias or norm cannot hide behind zeros and ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            is_norm = p.ndim == 1 and any(k in name for k in ("norm", "ln_"))
            p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.05 * noise)


def our_model(cfg: ModelConfig, vocab: int, seed: int = 0) -> torch.nn.Module:
    return build_model(cfg, vocab, seed=seed).double().eval()


def ids_for(vocab: int, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(7))


def compare_outputs(ours: torch.nn.Module, theirs: torch.nn.Module, cfg: ModelConfig, vocab: int) -> None:
    """Same logits, and the same mean next-token loss (transformers shifts `labels` itself)."""
    ids = ids_for(vocab)
    ref = theirs(ids, labels=ids)
    torch.testing.assert_close(ours.full_logits(ids), ref.logits, **LOGITS_TOL[cfg.family])
    # transformers: loss of logits[:, :-1] against ids[:, 1:]; causal, so ours on ids[:, :-1] is the same.
    torch.testing.assert_close(ours(ids[:, :-1], labels=ids[:, 1:]), ref.loss, **LOSS_TOL)


@pytest.mark.parametrize("overrides,vocab", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hf_weights_into_ours(overrides: dict, vocab: int) -> None:
    cfg = small_cfg(**overrides)
    theirs = hf_model(cfg, vocab)
    ours = our_model(cfg, vocab)
    load_hf_into(ours, theirs.state_dict(), cfg, vocab)
    assert ours.padded_vocab == padded_vocab(vocab, 128, 1)
    compare_outputs(ours, theirs, cfg, vocab)


@pytest.mark.parametrize("overrides,vocab", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_our_weights_into_hf(overrides: dict, vocab: int) -> None:
    cfg = small_cfg(**overrides)
    ours = our_model(cfg, vocab, seed=3)
    randomize(ours, seed=4)
    cls = hf_class(cfg)
    theirs = cls(hf_config(cfg, vocab, attn_implementation="eager")).double().eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg, vocab), strict=True)
    if cfg.tie_embeddings:
        assert theirs.lm_head.weight is theirs.get_input_embeddings().weight
    compare_outputs(ours, theirs, cfg, vocab)


@pytest.mark.parametrize("overrides,vocab", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_round_trips_are_exact(overrides: dict, vocab: int) -> None:
    cfg = small_cfg(**overrides)
    ours = our_model(cfg, vocab, seed=5)
    randomize(ours, seed=6)
    state = ours.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(state, cfg, vocab), cfg, vocab)
    assert list(back) == list(state)
    for name, t in state.items():
        expected = t
        if conversion_rules(cfg)[name].vocab:  # padding rows do not exist in transformers: they come back zero
            expected = torch.cat([t[:vocab], torch.zeros_like(t[vocab:])])
        torch.testing.assert_close(back[name], expected, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")

    hf_state = hf_model(cfg, vocab).state_dict()
    again = to_hf_state_dict(from_hf_state_dict(hf_state, cfg, vocab), cfg, vocab)
    assert sorted(again) == sorted(hf_state)
    for name, t in hf_state.items():
        torch.testing.assert_close(again[name], t, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("overrides,vocab", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gradients_match(overrides: dict, vocab: int) -> None:
    cfg = small_cfg(**overrides)
    theirs = hf_model(cfg, vocab)
    ours = our_model(cfg, vocab)
    load_hf_into(ours, theirs.state_dict(), cfg, vocab)
    ids = ids_for(vocab)
    theirs(ids, labels=ids).loss.backward()
    ours(ids[:, :-1], labels=ids[:, 1:]).backward()
    # keep_vars: the Parameters themselves, so a tied lm_head/wte pair shares one .grad
    ref = from_hf_state_dict({k: v.grad for k, v in theirs.state_dict(keep_vars=True).items()}, cfg, vocab)
    got = {name: p.grad for name, p in ours.named_parameters()}
    assert list(got) == list(ref)
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], **GRAD_TOL[cfg.family], msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("overrides,vocab", [c[1:] for c in CASES[::2]], ids=[c[0] for c in CASES[::2]])
def test_load_into_pipeline_stages(overrides: dict, vocab: int) -> None:
    """Every stage part (first with embeddings, a middle, last with head) gets the full model's tensors."""
    cfg = small_cfg(**(overrides | {"n_layers": 3, "tie_embeddings": True}))
    hf_state = hf_model(cfg, vocab).state_dict()
    full = our_model(cfg, vocab)
    load_hf_into(full, hf_state, cfg, vocab)
    reference = dict(full.named_parameters())
    stages = [build_model(cfg, vocab, layers=range(0, 1), pre=True, post=False),
              build_model(cfg, vocab, layers=range(1, 2), pre=False, post=False),
              build_model(cfg, vocab, layers=range(2, 3), pre=False, post=True)]
    for stage in stages:
        load_hf_into(stage.double(), hf_state, cfg, vocab)
        for name, p in stage.named_parameters():
            source = "tok_embed.weight" if name == "head.weight" else name  # tied head on the last stage
            torch.testing.assert_close(p, reference[source], atol=0, rtol=0)
    assert "head.weight" in dict(stages[-1].named_parameters())


def test_load_into_emulated_tp_rank() -> None:
    """A parameter carrying a TP `Shard` receives its slice (fused Q|K|V parts, row-parallel columns)."""
    cfg, vocab, tp = small_cfg(family="llama", n_kv_heads=2, ffn_hidden=96, tie_embeddings=False), 300, 2
    hf_state = hf_model(cfg, vocab).state_dict()
    full = from_hf_state_dict(hf_state, cfg, vocab)
    q, kv = 64, 32
    for rank in range(tp):
        model = our_model(cfg, vocab)
        qkv_shard, down_shard = Shard(0, (q, kv, kv), rank, tp), Shard(1, (96,), rank, tp)
        attn, mlp = model.layers["0"].attn, model.layers["0"].mlp
        attn.qkv.weight = torch.nn.Parameter(qkv_shard.slice(torch.zeros(q + 2 * kv, 64, dtype=torch.float64)))
        annotate(attn.qkv.weight, Init("zeros"), qkv_shard)
        mlp.down.weight = torch.nn.Parameter(down_shard.slice(torch.zeros(64, 96, dtype=torch.float64)))
        annotate(mlp.down.weight, Init("zeros"), down_shard)
        load_hf_into(model, hf_state, cfg, vocab)
        wq, wk, wv = (hf_state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
        expect_qkv = torch.cat([w.chunk(tp)[rank] for w in (wq, wk, wv)])
        torch.testing.assert_close(attn.qkv.weight, expect_qkv, atol=0, rtol=0)
        expect_down = hf_state["model.layers.0.mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        torch.testing.assert_close(mlp.down.weight, expect_down, atol=0, rtol=0)
        torch.testing.assert_close(model.layers["1"].attn.qkv.weight, full["layers.1.attn.qkv.weight"])


def hf_param_count(cfg: ModelConfig, vocab: int) -> int:
    cls = hf_class(cfg)
    with torch.device("meta"):
        model = cls(hf_config(cfg, vocab))
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("name,vocab", [("gpt-tiny", 300), ("llama-tiny", 8192), ("gpt-1b", None), ("llama-1b", None)])
def test_analytic_param_count(model_config, name: str, vocab: int | None) -> None:
    cfg = model_config(name)
    vocab = vocab or cfg.vocab_size
    with torch.device("meta"):
        ours = build_model(cfg, vocab)
    counted = sum(p.numel() for p in ours.parameters())
    assert analytic_param_count(cfg, vocab) == counted
    # transformers' model of the padded vocabulary has exactly our parameters ...
    assert hf_param_count(cfg, padded_vocab(vocab, cfg.make_vocab_size_divisible_by, 1)) == counted
    # ... and without padding, the real vocabulary's.
    unpadded = dataclasses.replace(cfg, make_vocab_size_divisible_by=1)
    assert analytic_param_count(unpadded, vocab) == hf_param_count(unpadded, vocab)
