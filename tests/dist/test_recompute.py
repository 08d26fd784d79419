"""Activation recomputation (`train.recompute=selective|full`) against the run that keeps every activation.

- One process, GPT and Llama, dropout 0 and 0.1: the loss and every parameter gradient are bit-identical to
  `train.recompute=none` (the recomputed dropout masks are the forward's).
- tp=2 with and without sequence parallelism, dropout 0.1 (masks from the default generator and from each
  TP rank's stream): bit-identical on every rank.
- What autograd keeps per layer (the shared saved-tensor tally): under `full` the blocks' inputs only; under
  `selective` what `none` keeps less, per layer, what PyTorch's own attention call and the MLP activation
  keep beyond their inputs and outputs (tallied on the same shapes).
Training through the pipeline with recomputation is in test_pp.py's launches (against the single process).
The tp=2 launch's configs are composed in the test process before the ranks fork (`compose_config`'s memo),
whose heap is frozen while they run (`run_frozen`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tp_helpers import run_frozen

from hybrid.config import compose_config
from hybrid.model import build_model
from hybrid.model.traffic import tp_bytes_per_microbatch
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.testing.activations import saved_tally

VOCAB, B, S = 100, 2, 16
MODES = ("none", "selective", "full")


def _cfg(family: str, dropout: float) -> Any:
    """The 2-layer model config (composed once per family in a process; the dropout set on the copy)."""
    cfg = compose_config([f"model={family}-tiny", "model.n_layers=2", "model.hidden=64", "model.n_heads=4",
                          "model.ffn_hidden=128", "model.max_seq_len=32"]).model
    cfg.dropout = dropout
    return cfg


def one_pass(family: str, dropout: float, mode: str, tp_group: Any = None, sp: bool = False) -> dict[str, Any]:
    """Loss, gradients, the tally and the TP bytes of one forward + backward under `mode` (the same seeds)."""
    model = build_model(_cfg(family, dropout), VOCAB, tp_group, seed=1, sequence_parallel=sp)
    model.set_recompute(mode)
    model.train()
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    C.COUNTER.reset()
    with saved_tally(model) as seen:
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    layers = sum(n for region, n in seen.values() if region == "layers")
    tp = {op: b for (group, op), b in C.COUNTER.bytes.items() if group == "tp" and b}
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}, "layers": layers,
            "tp": tp}


def assert_identical(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert torch.equal(ours["loss"], ref["loss"]), where
    for name, g in ref["grads"].items():
        assert torch.equal(ours["grads"][name], g), f"{where}: {name}"


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_is_bit_identical_in_one_process(family: str, dropout: float) -> None:
    torch.set_num_threads(1)
    ref = one_pass(family, dropout, "none")
    for mode in MODES[1:]:
        assert_identical(one_pass(family, dropout, mode), ref, f"{family} dropout={dropout} {mode}")


def tp_passes(rank: int, world: int) -> list[str]:
    ctx = ParallelContext.build(Layout.create(world, tp=world))
    checked = []
    for family in ("gpt", "llama"):
        for sp in (False, True):
            ref = one_pass(family, 0.1, "none", ctx.tp_group, sp)
            for mode in MODES:
                ours = ref if mode == "none" else one_pass(family, 0.1, mode, ctx.tp_group, sp)
                assert_identical(ours, ref, f"{family} sp={sp} {mode}")
                # full recomputation reruns each layer's forward collectives; selective none
                want = tp_bytes_per_microbatch(_cfg(family, 0.1), B, S, world, sp, recompute=mode)
                assert ours["tp"] == want, (family, sp, mode, ours["tp"], want)
                checked.append(f"{family}-sp{sp}-{mode}")
    return checked


def test_recompute_replays_every_dropout_stream_under_tp() -> None:
    for family in ("gpt", "llama"):  # composed here once, inherited by the forked ranks
        _cfg(family, 0.1)
    results = run_frozen(tp_passes, 2, timeout=120)
    assert all(len(r) == 12 for r in results)


def _kept_beyond(run: Any, inputs: list[torch.Tensor], weights: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes `run(*inputs)` saves for backward other than its inputs', weights' and output's storages."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(*inputs)
    for t in (*inputs, *weights, out):
        seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(seen.values())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_recompute_keeps_what_it_says_per_layer(family: str) -> None:
    torch.set_num_threads(1)
    cfg = _cfg(family, 0.0)
    kept = {mode: one_pass(family, 0.0, mode)["layers"] for mode in MODES}
    assert kept["full"] == cfg.n_layers * B * S * cfg.hidden * 4  # each block's input, fp32
    heads, d = cfg.n_heads, cfg.hidden // cfg.n_heads
    q, k, v = (torch.randn(B, heads, S, d, requires_grad=True) for _ in range(3))
    core = _kept_beyond(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True), [q, k, v])
    width = 2 * cfg.ffn_hidden if family == "llama" else cfg.ffn_hidden
    h = torch.randn(B, S, width, requires_grad=True)
    w = torch.randn(cfg.hidden, cfg.ffn_hidden, requires_grad=True)
    model = build_model(cfg, VOCAB, seed=1)
    act = model.layers["0"].mlp.act
    mlp = _kept_beyond(lambda x: F.linear(act(x), w), [h], (w,))
    assert core > 0 and mlp > 0
    assert kept["selective"] == kept["none"] - cfg.n_layers * (core + mlp), kept
