"""Analytic TP traffic of our models: what `collectives.COUNTER` must count, op by op.

Bytes are the whole tensor each collective works on (see `hybrid.parallel.collectives`);
b = micro batch, s = sequence length, h = hidden. `itemsize` is the element size of the
activations exchanged inside and around the TP regions: 4 in fp32, 2 under bf16 autocast
(column-parallel inputs are cast before their exchange; row-parallel outputs are bf16) and under bf16
parameters. `residual` is the residual stream's: the embedding's output and its gradient, and the
pipeline's hidden states — fp32 (4) also under autocast, 2 under bf16 parameters
(`train.precision=bf16_params`). The cross-entropy's reductions are fp32 whatever they are.

Per microbatch, forward + backward, tp > 1:

- without sequence parallelism, all-reduces of b·s·h: 4 per layer (attention and MLP
  outputs forward; their column-parallel inputs' gradients backward), 1 for the embedding
  (forward), 1 for the head's input gradient (backward);
- with sequence parallelism, each all-reduce becomes an all-gather + a reduce-scatter of the
  same b·s·h tensor (the same ring volume), plus Megatron's backward re-gather of every
  column-parallel input: 2 per layer and 1 for the head;
- in both, the vocab-parallel cross-entropy's three fp32 all-reduces of b·s elements;
- with the fused head (`train.fused_head`, `hybrid.parallel.tp.fused_head`) the same, but for the head's
  regather under sequence parallelism: the head's weight gradient is made in the forward, from the input it
  gathered then;
- under full recomputation (`train.recompute=full`) each layer's forward runs again in the backward, and
  its collectives with it: 2 more all-reduces per layer, or 2 more all-gathers and 2 more reduce-scatters
  under sequence parallelism (selective recomputation reruns none).

Per step: under sequence parallelism, one all-reduce of the gradients of the replicated
parameters applied to sequence chunks (norms, row-parallel biases, positions); and the
gradient-norm's scalar all-reduce.

Context parallelism (`cp_bytes_per_microbatch`, per layer, one rank, its local s/cp tokens of its TP heads):
the ring sends K and V on cp−1 hops forward and again backward, plus cp−1 hops of their fp32 gradients; the
all-to-all exchange moves q, k, v and the output forward and their gradients backward (K/V repeated to one per
query head when they do not divide by cp). Recomputation (selective reruns the attention core, full the block)
repeats the forward's. Under CP every other formula here takes a rank's tokens: `seq_len` / cp (TP's regions
and PP's hidden states carry only those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid.model.family import family_of
from hybrid.parallel.pp.actions import part_of, place_of

if TYPE_CHECKING:
    from hybrid.config import ModelConfig


def tp_bytes_per_microbatch(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                            layers: int | None = None, pre: bool = True, post: bool = True,
                            itemsize: int = 4, recompute: str = "none", residual: int = 4,
                            fused_head: bool = False) -> dict[str, int]:
    """{op: bytes} one rank's TP group moves for one microbatch, forward and backward."""
    if tp == 1:
        return {}
    n_layers = cfg.n_layers if layers is None else layers
    bsh = micro_batch * seq_len * cfg.hidden
    per_layer = 6 if recompute == "full" else 4  # the forward's two run twice under full recomputation
    inner = (per_layer * n_layers + int(post)) * bsh * itemsize  # layers, and the head's input (gradient)
    embed = bsh * residual if pre else 0  # forward reduce (and, under SP, the gradient's all-gather)
    ce = 3 * micro_batch * seq_len * 4 if post else 0
    if not sequence_parallel:
        out = {"all_reduce": inner + embed + ce}
    else:
        out = {"all_gather": inner + embed, "reduce_scatter": inner + embed,
               "regather": (2 * n_layers + int(post and not fused_head)) * bsh * itemsize, "all_reduce": ce}
    return {op: b for op, b in out.items() if b}


def sequence_parallel_grad_elements(cfg: ModelConfig, layers: int | None = None, pre: bool = True,
                                    post: bool = True) -> int:
    """Gradient elements summed over TP once per step under sequence parallelism: the norms
    (LayerNorm: weight and bias), the row-parallel biases, learned positions (the family's blocks)."""
    blocks, h = family_of(cfg).blocks, cfg.hidden
    n_layers = cfg.n_layers if layers is None else layers
    norm = h if blocks.norm == "rms" else 2 * h
    per_layer = 2 * norm + (2 * h if blocks.bias else 0)  # two norms; two row-parallel biases
    positions = cfg.max_seq_len * h if blocks.positions == "learned" and pre else 0
    return n_layers * per_layer + (norm if post else 0) + positions


def tp_bytes_per_step(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                      microbatches: int, itemsize: int = 4, recompute: str = "none", residual: int = 4,
                      fused_head: bool = False) -> dict[str, int]:
    """{op: bytes} of one whole-model optimizer step (pp=1): every microbatch, the sequence-parallel
    gradient all-reduce (fp32) and the gradient norm's fp32 scalar all-reduce."""
    if tp == 1:
        return {}
    per_mb = tp_bytes_per_microbatch(cfg, micro_batch, seq_len, tp, sequence_parallel, itemsize=itemsize,
                                     recompute=recompute, residual=residual, fused_head=fused_head)
    out = {op: b * microbatches for op, b in per_mb.items()}
    extra = 4 + (4 * sequence_parallel_grad_elements(cfg) if sequence_parallel else 0)
    out["all_reduce"] = out.get("all_reduce", 0) + extra
    return out


def pp_bytes_per_step(micro_batch: int, seq_len: int, hidden: int, tp: int, sequence_parallel: bool,
                      microbatches: int, pp: int, virtual_stages: int, pp_rank: int, itemsize: int = 4,
                      placement: str = "loop") -> dict[str, int]:
    """{op: bytes} one rank sends over its PP group in one optimizer step.

    Every microbatch crosses each boundary between model parts once forward (its hidden states)
    and once backward (their gradient): b·s·h elements of `itemsize` bytes (the residual stream's dtype: fp32,
    also under bf16 autocast; bf16 under bf16 parameters), or the b·(s/tp)·h sequence chunk under sequence
    parallelism. Rank r holds
    parts r, r+pp, … (or, under the V `placement`, parts r and 2·pp−1−r): it sends forward from each part
    but the last and backward from each part but the first, except to a neighbouring part on the same rank
    (the V's turn, handed over in memory). Plus the gradient norm's fp32 scalar all-reduce over PP.
    """
    if pp == 1:
        return {}
    seq = seq_len // tp if sequence_parallel and tp > 1 else seq_len
    per_message = micro_batch * seq * hidden * itemsize
    last = pp * virtual_stages - 1
    parts = [part_of(placement, pp, pp_rank, c) for c in range(virtual_stages)]
    away = [t for t in range(pp * virtual_stages) if place_of(placement, pp, t)[0] != pp_rank]
    out = {"send_fwd": sum(s < last and s + 1 in away for s in parts) * microbatches * per_message,
           "send_bwd": sum(s > 0 and s - 1 in away for s in parts) * microbatches * per_message,
           "all_reduce": 4}
    return {op: b for op, b in out.items() if b}


def cp_bytes_per_microbatch(cfg: ModelConfig, micro_batch: int, seq_len: int, cp: int, comm: str, tp: int = 1,
                            layers: int | None = None, itemsize: int = 4, recompute: str = "none") -> dict[str, int]:
    """{op: bytes} one rank sends over its CP group for one microbatch, forward and backward (`itemsize`: q, k,
    v's element size — 2 under bf16 autocast or parameters; the ring's K/V gradients are fp32 whatever)."""
    if cp == 1:
        return {}
    d, heads = cfg.hidden // cfg.n_heads, cfg.n_heads // tp
    kv = (cfg.n_kv_heads or cfg.n_heads) // tp
    head = micro_batch * (seq_len // cp) * d  # one head's local tokens, elements
    forwards = 2 if recompute != "none" else 1  # the attention core reruns in the backward
    n_layers = cfg.n_layers if layers is None else layers
    if comm == "ring":
        sent = (cp - 1) * 2 * kv * head * ((forwards + 1) * itemsize + 4)
        return {"ring": n_layers * sent}
    moved = kv if kv % cp == 0 else heads
    return {"all_to_all": n_layers * (forwards + 1) * (2 * heads + 2 * moved) * head * itemsize}
