"""The fused head (`hybrid.parallel.tp.fused_head`) in one process, against the unfused head.

Reference: `vocab_parallel_cross_entropy(column_linear(x, W))` on the same tensors (tp=1, the padded vocabulary's
extra rows sliced off). Tolerances: fp32 — rtol = 1e-5, atol = 1e-6 (the chunks sum the loss and W's gradient in
another order: measured max abs error 5e-7 on the loss, 5e-8 on the gradients); bf16 (autocast or bf16
parameters) — rtol = 2e-2 and atol = 1 % of the reference's largest entry (the unfused head rounds W's
gradient to bf16 once, the fused one each chunk's product before its fp32 sum); the split backward against one
full backward — bit for bit. The TP layouts and zb1p under a pipeline run on gloo ranks:
tests/dist/test_fused_head_ranks.py.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybrid.config import ConfigError, compose_config
from hybrid.data import Corpus
from hybrid.model import build_model
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.pp.split_backward import SavedTensors, backward_input
from hybrid.parallel.tp.fused_head import fused_linear_cross_entropy, head_chunk
from hybrid.parallel.tp.tensor import column_linear, vocab_parallel_cross_entropy
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

VOCAB, PADDED, H = 51, 64, 16  # the vocabulary is no multiple of any chunk below
F32_TOL = {"rtol": 1e-5, "atol": 1e-6}
GEN = torch.Generator().manual_seed(0)
X, W = torch.randn(2, 7, H, generator=GEN), torch.randn(PADDED, H, generator=GEN)  # 14 tokens
TARGET = torch.randint(0, VOCAB, (2, 7), generator=GEN)


def head(fused: int, x: torch.Tensor = X, w: torch.Tensor = W) -> tuple[torch.Tensor, ...]:
    """(loss, x's gradient, W's gradient) with the fused head in chunks of `fused` tokens, or (0) unfused; the
    backward from 0.7 · loss, so the scaling of the kept gradients counts."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if fused:
        loss = fused_linear_cross_entropy(x, w, TARGET, None, VOCAB, fused)
    else:
        loss = vocab_parallel_cross_entropy(column_linear(x, w, None, None), TARGET, None, VOCAB)
    (0.7 * loss).backward()
    return loss.detach(), x.grad, w.grad


def bf16_tol(ref: torch.Tensor) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 1e-2 * float(ref.float().abs().max())}


@pytest.mark.parametrize("chunk", [1, 5, 14, 100])  # a token at a time; uneven; the whole; more than there is
def test_the_fused_head_equals_the_unfused_one_at_tp1(chunk: int) -> None:
    ours, ref = head(chunk), head(0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **F32_TOL)
    assert not ours[2][VOCAB:].any()  # padded rows never count


def test_evaluation_computes_only_the_loss() -> None:
    with torch.no_grad():
        loss = fused_linear_cross_entropy(X, W, TARGET, None, VOCAB, 4)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, head(0)[0], **F32_TOL)


def test_bf16_autocast_and_bf16_parameters_stay_within_bf16_rounding() -> None:
    ref = head(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, unfused = head(5), head(0)
    low = head(5, X.bfloat16(), W.bfloat16())
    assert [t.dtype for t in autocast[1:]] == [torch.float32] * 2 and [t.dtype for t in low[1:]] == [torch.bfloat16] * 2
    for ours, theirs in ((autocast, unfused), (low, ref)):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.float(), b.float(), **bf16_tol(b))


@functools.cache
def _composed() -> object:
    """A tiny gpt (tied head; vocabulary 51 padded to 64), composed once (Hydra: ~0.2 CPU-s a composition)."""
    return compose_config(["model=gpt-tiny", "model.n_layers=2", "model.hidden=32", "model.n_heads=4",
                           "model.max_seq_len=16", "model.make_vocab_size_divisible_by=64", "data.seq_len=7",
                           "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
                           "train.device=cpu", "train.precision=fp32"])


def model_cfg(extra: tuple[str, ...] = ()) -> object:
    """A copy of the tiny config with `key=value` overrides of plain values (typed by the schema)."""
    cfg = copy.deepcopy(_composed())
    for override in extra:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg


def test_a_tied_model_learns_the_same_with_the_fused_head() -> None:
    """gpt ties its head to the token embedding: the fused head's W gradient adds to the embedding's."""
    cfg = model_cfg()
    plain = build_model(cfg.model, VOCAB, seed=1)
    fused = copy.deepcopy(plain)
    fused.set_fused_head("on", 3)
    ids = torch.cat([TARGET[:, :1], TARGET], dim=1)
    for model in (plain, fused):
        model(ids[:, :-1], ids[:, 1:]).backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **F32_TOL, msg=name)
    assert torch.equal(fused.full_logits(ids), plain.full_logits(ids))  # the logits path stays unfused
    assert (head_chunk("auto", 8, "cpu"), head_chunk("auto", 8, "cuda"), head_chunk("off", 8, "cuda")) == (0, 8, 0)
    with pytest.raises(ValueError, match="fused head"):
        fused.set_fused_head("sometimes")


def test_the_split_backward_gives_each_gradient_once() -> None:
    """A last pipeline part under a zero-bubble schedule: the input pass makes x's gradient (and none of the
    weights'), the weight pass the head's from the fused node's kept gradient — bit for bit one full backward's."""
    cfg = model_cfg()
    full = build_model(cfg.model, VOCAB, layers=range(1, 2), pre=False, post=True, seed=3)
    full.set_fused_head("on", 4)
    split = copy.deepcopy(full)
    x = torch.randn(2, 7, 32, generator=GEN)
    counts = {n: 0 for n, _ in split.named_parameters()}
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: counts.__setitem__(n, counts[n] + 1))
    inp, inp2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    full(inp, TARGET).backward()
    saved = SavedTensors()
    with saved.hooks():
        out = split(inp2, TARGET)
    work = backward_input(out, None, inp2, saved)
    assert torch.equal(inp.grad, inp2.grad) and sum(counts.values()) == 0
    work.run()
    assert counts == {n: 1 for n in counts}
    for (n, p), q in zip(full.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


def corpus() -> Corpus:
    rng = np.random.default_rng(0)
    starts, steps = rng.integers(0, VOCAB, size=(24, 1)), rng.integers(1, 4, size=(24, 1))
    samples = ((starts + steps * np.arange(8)) % VOCAB).astype(np.int32)
    return Corpus(tokenizer=None, vocab_size=VOCAB, eos_id=0, train=samples[:-4], eval=samples[-4:], seq_len=7)


def test_training_with_the_fused_head_tracks_the_unfused_run() -> None:
    """Three AdamW steps (and an eval) with train.fused_head=on against off: the same run within fp32 rounding."""
    runs = {}
    for mode in ("on", "off"):
        cfg = model_cfg((f"train.fused_head={mode}", "train.head_chunk=5", "train.steps=3"))
        ctx = ParallelContext.single()
        trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), corpus(), torch.device("cpu"), log=lambda _: None)
        losses = [trainer.train_step().loss for _ in range(3)]
        runs[mode] = (losses, trainer.evaluate(), [p.detach().clone() for p in trainer.model.parameters()])
    assert runs["on"][0][-1] < runs["on"][0][0]
    torch.testing.assert_close(torch.tensor(runs["on"][0] + [runs["on"][1]]),
                               torch.tensor(runs["off"][0] + [runs["off"][1]]), **F32_TOL)
    for a, b in zip(runs["on"][2], runs["off"][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # Adam's lr·g/|g| amplifies round-off (test_pp)


@pytest.mark.parametrize("override,needle", [("train.fused_head=sometimes", "train.fused_head='sometimes' is not"),
                                             ("train.head_chunk=0", "train.head_chunk must be >= 1")])
def test_bad_values_are_one_line(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        validate(model_cfg((override,)), 1)
    assert "\n" not in str(e.value)


def test_the_benchmark_runs_and_both_sides_agree(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m hybrid.bench.fused_head` at a tiny shape: its table, and the two heads' agreement."""
    from hybrid.bench import fused_head

    threads = torch.get_num_threads()
    try:
        assert fused_head.main(["--model", "gpt-tiny", "--vocab", "100", "--batch", "1", "--seq", "8", "--chunk", "3",
                                "--rounds", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| fused " in out and "gradients agree: True" in out, out
