"""The fused head (`hybrid.parallel.tp.fused_head`) on gloo ranks: under TP against tp=1, and under zb1p.

One launch of 2 ranks (`launched`) runs:
- the head alone at tp=2, without and with sequence parallelism, fp32 and bf16 autocast, on a vocabulary
  padded beyond the real one (51 of 64: rank 1 holds 32..50 and padding; 20 of 64: rank 1 holds padding only):
  loss, x's gradient (this rank's sequence chunk under SP) and W's gradient (this rank's rows) against the
  unfused head at tp=1 on the full tensors; and the TP bytes it counts against the unfused head's at tp=2;
- gpt (tied embedding) trained 2 steps at pp2 under zb1p (ZB-H1's order: the last stage's backward split into
  input and weight passes) and under 1F1B, both with the fused head in chunks of 12 tokens (a microbatch is 32):
  the split backward must give the same gradients, accumulated once;
- gpt trained at tp2 with SP and the fused head, against the single process with the unfused head, and its
  counted TP bytes against `tp_bytes_per_step(..., fused_head=True)` (no head regather).

Tolerances: fp32 — rtol = 1e-5, atol = 1e-6 (the loss's reductions run in another order; measured max abs
error ~1e-7); bf16 autocast — rtol = 2e-2 and atol = 1 % of the reference's largest entry (x's gradient is
summed over the vocabulary shards in bf16 under TP; the tp=1 head rounds W's gradient to bf16 once, the fused
one per chunk); zb1p against 1F1B — bit for bit; the whole model against the single process — pp_helpers'
LOSS_TOL / NORM_TOL / WEIGHT_TOL, as every layout is held.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from pp_helpers import SEQ, Case, assert_matches_reference, make_cfg, reference, train_case
from tp_helpers import TIMEOUT, leaf, randn, run_frozen, traffic

from hybrid.model.traffic import tp_bytes_per_step
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.pp.actions import Op
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.parallel.tp.fused_head import fused_linear_cross_entropy
from hybrid.parallel.tp.tensor import column_linear, vocab_parallel_cross_entropy

B, S, H, PADDED, CHUNK = 2, 8, 16, 64, 5  # 16 tokens in chunks of 5, 5, 5, 1
F32_TOL = {"rtol": 1e-5, "atol": 1e-6}
FUSED = ("train.fused_head=on", "train.head_chunk=12")
ZB_H1 = ("parallel.zb_memory=none",)  # the schedule's own order: the last stage splits (fitted, it would not here)
CASES = [Case("gpt", pp=2, schedule="zb1p", layers=2, extra=(*FUSED, *ZB_H1)), Case("gpt", pp=2, layers=2, extra=FUSED),
         Case("gpt", tp=2, sp=True, layers=2, extra=FUSED)]
HEADS = [(51, False, False), (51, True, False), (20, False, False), (51, True, True)]  # vocab, sp, bf16


def head(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, group: Any, vocab: int, sp: bool,
         fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, x's gradient, W's gradient) of the fused or the unfused head."""
    x, w = leaf(x), leaf(w)
    if fused:
        loss = fused_linear_cross_entropy(x, w, target, group, vocab, CHUNK, sp)
    else:
        loss = vocab_parallel_cross_entropy(column_linear(x, w, None, group, sp), target, group, vocab)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def head_case(group: Any, vocab: int, sp: bool, bf16: bool) -> dict[str, Any]:
    """This rank's fused head at tp=2 against the unfused one at tp=1; the bytes of both at tp=2."""
    n, r = C.size(group), C.rank(group)
    x, w = randn(1, B, S, H).float(), randn(2, PADDED, H).float()
    target = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(3))
    rows = slice(r * PADDED // n, (r + 1) * PADDED // n)  # this rank's vocabulary shard
    seq = slice(r * S // n, (r + 1) * S // n) if sp else slice(None)  # this rank's sequence chunk (SP)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref = head(x, w, target, None, vocab, False, fused=False)
        counted = {}
        for fused in (True, False):
            C.COUNTER.reset()
            ours = head(x[:, seq], w[rows], target, group, vocab, sp, fused)
            counted[fused] = traffic()
    pairs = {"loss": (ours[0], ref[0]), "x": (ours[1], ref[1][:, seq]), "w": (ours[2], ref[2][rows])}
    return {"pairs": pairs, "bytes": {k: {op: b for op, (b, _) in t.items()} for k, t in counted.items()}}


def rank_work(rank: int, world: int) -> dict[str, Any]:
    contexts = {(c.tp, c.pp): ParallelContext.build(Layout.create(world, tp=c.tp, pp=c.pp)) for c in CASES}
    group = contexts[2, 1].tp_group
    return {"heads": [head_case(group, *h) for h in HEADS],
            "train": [train_case(contexts[c.tp, c.pp], c, world) for c in CASES]}


@functools.cache
def launched() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    for case in CASES:  # composed here once, inherited by the forked ranks
        make_cfg(case, 2)
    return run_frozen(rank_work, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("i", range(len(HEADS)), ids=[f"vocab{v}{'-sp' if s else ''}{'-bf16' if b else ''}"
                                                       for v, s, b in HEADS])
def test_the_fused_head_under_tp_matches_the_unfused_head_at_tp1(i: int) -> None:
    bf16 = HEADS[i][2]
    for rank, out in enumerate(launched()):
        for name, (ours, ref) in out["heads"][i]["pairs"].items():
            tol = {"rtol": 2e-2, "atol": 1e-2 * float(ref.abs().max())} if bf16 else F32_TOL
            torch.testing.assert_close(ours, ref, **tol, msg=lambda m, n=name, r=rank: f"rank {r} {HEADS[i]} {n}: {m}")


@pytest.mark.parametrize("i", range(len(HEADS)))
def test_the_fused_head_moves_the_unfused_heads_bytes_but_the_regather(i: int) -> None:
    """The same all-reduces (3·b·s fp32 for the loss; x's gradient without SP) and, under SP, the same
    all-gather and reduce-scatter: only the unfused head's backward regather is gone."""
    for out in launched():
        fused, unfused = out["heads"][i]["bytes"][True], dict(out["heads"][i]["bytes"][False])
        assert ("regather" in unfused) == HEADS[i][1]
        unfused.pop("regather", None)
        assert fused == unfused, (HEADS[i], fused, unfused)


def test_zb1p_with_the_fused_head_equals_1f1b_bit_for_bit() -> None:
    """gpt at pp2, its embedding tied to the last stage's head: the weight pass gives the head its gradient
    once, the input pass x's — the same numbers as one full backward."""
    zb = build_schedule("zb1p", 2, launched()[0]["train"][0]["microbatches"])  # the order ZB_H1 runs
    assert any(a.op is Op.BACKWARD_WEIGHT for a in zb.actions[1])  # the last stage's backward is split
    for a, b in ((r["train"][0], r["train"][1]) for r in launched()):  # zb1p, 1F1B on each rank
        assert (a["losses"], a["norms"], a["eval"]) == (b["losses"], b["norms"], b["eval"]), a["coord"]
        for name, w in (a["state"] or {}).items():
            assert torch.equal(w, b["state"][name]), (a["coord"], name)
    assert_matches_reference([r["train"][0] for r in launched()], reference("gpt", 2))


def test_tp2_sp_training_with_the_fused_head_matches_the_single_process_and_its_bytes() -> None:
    results = [r["train"][2] for r in launched()]
    assert_matches_reference(results, reference("gpt", 2))
    cfg = make_cfg(CASES[2], 2)
    want = tp_bytes_per_step(cfg.model, cfg.train.micro_batch_size, SEQ, 2, True, results[0]["microbatches"],
                             fused_head=True)
    for r in results:
        for step in r["bytes"]:
            assert {op: b for (g, op), b in step.items() if g == "tp"} == want, (r["coord"], step, want)
