"""The model-family seam is real: a family defined here, through the public seam only, trains.

"toy" is a GPT variant that no module of hybrid knows: RMSNorm, SwiGLU, no biases (Llama's
blocks) with learned positions and tied embeddings (GPT's). It is registered when this module is
imported, so the forked ranks know it too. Then, with nothing else changed:

- `model.family=toy` passes `validate`, the built model holds exactly the tensors its blocks
  imply (no bias anywhere, weight-only norms, a fused gate|up, learned positions, no RoPE tables),
  its parameter count equals the family's analytic one, its checkpoint shape and its sequence
  length check come from the family, and it has no transformers counterpart (a clear error);
- trained at tp2pp2 (4 gloo ranks, with and without sequence parallelism; a 4-layer model, the configs
  composed before the ranks fork) it matches its own
  single-process run: losses, gradient norms and eval loss within the layout tests' tolerances
  (tests/dist/pp_helpers.py: rtol = atol = 1e-5), weights within WEIGHT_TOL, the tied head equal
  to the embedding bit for bit, and the parameter count summed over stages equal to the analytic one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks
from pp_helpers import LOSS_TOL, TIMEOUT, VOCAB, Case, assert_matches_reference, make_cfg, reference, train_cases

from hybrid.checkpoint import model_shape
from hybrid.config import ConfigError, compose_config
from hybrid.model import analytic_param_count, build_model
from hybrid.model.family import Blocks, Family, ModelConfigError, family_names, get_family, register_family
from hybrid.model.gpt import check_learned_positions, learned_positions_shape
from hybrid.model.hf import hf_config
from hybrid.model.llama import llama_param_count
from hybrid.validation import validate


def toy_param_count(cfg: Any, vocab_size: int, tp: int = 1) -> int:
    """Llama's count (the same blocks: RMSNorm, SwiGLU, no biases) plus the S·h learned positions."""
    return llama_param_count(cfg, vocab_size, tp) + cfg.max_seq_len * cfg.hidden


TOY = register_family(Family(
    name="toy",
    blocks=Blocks(norm="rms", mlp="swiglu", bias=False, positions="learned"),
    param_count=toy_param_count,
    check_seq_len=check_learned_positions,
    shape=learned_positions_shape,
))


def test_the_toy_family_is_known_everywhere_through_the_seam() -> None:
    assert family_names()[:2] == ("gpt", "llama") and "toy" in family_names()
    assert register_family(TOY) is TOY  # the same record again is harmless
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_family(Family(name="toy", blocks=TOY.blocks, param_count=llama_param_count))
    cfg = make_cfg(Case("toy"), 1)  # validated
    model = build_model(cfg.model, VOCAB)
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(".bias") for n in names), sorted(names)
    assert "pos_embed.weight" in names and "head.weight" not in names  # learned positions, tied head
    assert not hasattr(model, "rope_cos")
    ffn, h = cfg.model.ffn_hidden, cfg.model.hidden
    assert model.layers["0"].mlp.up.weight.shape == (2 * ffn, h)  # SwiGLU's fused gate|up
    assert sum(p.numel() for p in model.parameters()) == analytic_param_count(cfg.model, VOCAB)
    assert model_shape(cfg.model, VOCAB)["max_seq_len"] == cfg.model.max_seq_len
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        validate(compose_config(["model.family=toy", "data.seq_len=4096"]), 1)
    with pytest.raises(ModelConfigError, match="model.family='toy' has no transformers counterpart"):
        hf_config(cfg.model, VOCAB)


def test_an_unknown_family_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"model.family='nope' is not one of gpt, llama, .*toy"):
        validate(compose_config(["model.family=nope"]), 1)
    with pytest.raises(ModelConfigError, match="model.family='nope' is not one of") as e:
        get_family("nope")
    assert "\n" not in str(e.value)


LAYERS = 4  # two per stage
CASES = [Case("toy", tp=2, pp=2, layers=LAYERS), Case("toy", tp=2, pp=2, sp=True, layers=LAYERS)]


def test_the_toy_family_at_tp2pp2_matches_its_single_process_run() -> None:
    torch.set_num_threads(1)
    ref = reference("toy", LAYERS)  # asserts that the loss falls and the count is the analytic one
    for case in CASES:  # composed here once, inherited by the forked ranks
        make_cfg(case, 4)
    results = run_ranks(train_cases, 4, CASES, timeout=TIMEOUT)
    for i, case in enumerate(CASES):
        by_rank = [r[i] for r in results]
        assert {r["case"] for r in by_rank} == {str(case)}
        assert_matches_reference(by_rank, ref)
        for r in by_rank:
            torch.testing.assert_close(torch.tensor(r["eval"]), torch.tensor(ref["eval"]), **LOSS_TOL)
