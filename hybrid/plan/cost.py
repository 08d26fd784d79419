"""The cost model: seconds of one microbatch's forward and backward on one pipeline stage, and of each exchange.

Compute is FLOPs over the device's peak at the efficiency of the op's class (`hardware.Device`): the GEMMs (QKV,
attention output, MLP, head; forward 2·tokens·in·out, backward twice that), attention, and the elementwise ops
(norms, residual adds, the MLP's activation: bytes over the memory bandwidth), plus a fixed cost per kernel.
Attention by its kernel (`ATTENTION`): `flash` (what hybrid runs on a GPU: torch's fused SDPA) computes
4·pairs·d per head forward, pairs = b·s²/2 over the CP ranks (causal), 2.5× that backward, at the attention
efficiency; `unfused` (the scores materialised, a fused scale-mask-softmax, dropout — Megatron-LM before flash
attention) multiplies the whole s × s at GEMM efficiency and moves about 13 bytes a score forward (scores written,
softmax read and written, dropout and its mask, read again by the product), twice that backward. Recomputation
adds the forward again (full) or the attention core (selective).

An exchange over n ranks takes (n − 1) hop latencies plus its wire bytes — nccl-tests' bus factor times the
payload: (n − 1)/n for an all-gather or a reduce-scatter, 2(n − 1)/n for an all-reduce — over the bus bandwidth
of the links the group crosses. TP's exchanges are hidden behind the GEMMs the overlap mode pairs them with
(`parallel.tp_overlap`: bulk the backward's, chunked the forward's too); what a GEMM cannot cover is exposed.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Optional

from hybrid.config import ModelConfig
from hybrid.model.family import family_of, ffn_hidden, kv_heads
from hybrid.plan.hardware import Device, Link

ELEMENTWISE_PER_H = 10  # bytes moved per token and hidden feature per layer forward, in activation elements
KERNELS = 24  # kernels per layer forward (backward: twice)
ATTENTION = ("flash", "unfused")
OPTIMIZER_BYTES = 34  # bytes Adam moves an element (`optimizer_s`)
UNFUSED_BYTES = 13  # bytes moved per attention score forward by the unfused kernels (fp16/bf16 scores, a byte mask)


@dataclass(frozen=True)
class Shape:
    """A decoder model as the cost model sees it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    swiglu: bool
    tied: bool = True  # the head shares the token embedding (one vocab × hidden matrix)

    @property
    def mlp_in(self) -> int:
        """The up projection's output width (SwiGLU's gate and up)."""
        return self.ffn * (2 if self.swiglu else 1)

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs per token trained (`record.metrics`' convention): 6·N + 12·L·h·s."""
        return 6.0 * (self.layers * self.layer_params() + self.vocab * self.hidden) + 12.0 * self.layers * (
            self.hidden * seq)

    def layer_params(self) -> int:
        d = self.hidden // self.heads
        return self.hidden * (self.hidden + 2 * self.kv_heads * d) + self.hidden ** 2 + self.hidden * (
            self.mlp_in + self.ffn)


def shape_of(m: ModelConfig, vocab: int) -> Shape:
    """The cost model's view of a model config (any family) with `vocab` ids."""
    swiglu = family_of(m).blocks.mlp == "swiglu"
    return Shape(m.n_layers, m.hidden, m.n_heads, kv_heads(m), ffn_hidden(m), vocab, swiglu, m.tie_embeddings)


@dataclass(frozen=True)
class Micro:
    """One microbatch on one rank: b sequences of s tokens, tp, cp, the activations' bytes, sequence parallel."""

    b: int
    s: int
    tp: int = 1
    cp: int = 1
    act: int = 2
    sp: bool = True

    @property
    def tokens(self) -> int:
        return self.b * self.s // self.cp


@dataclass(frozen=True)
class Pass:
    """Seconds of one layer's (or the head's) forward and backward on one rank: compute, and TP's and CP's exchanges
    (exposed: what no GEMM or attention block hides; total: all of it, hidden or not)."""

    forward: float
    backward: float
    tp_exposed: float = 0.0
    tp_total: float = 0.0
    cp_exposed: float = 0.0
    cp_total: float = 0.0

    def __add__(self, other: Pass) -> Pass:
        return Pass(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def times(self, n: float) -> Pass:
        return Pass(*(a * n for a in astuple(self)))

    def clocked(self) -> tuple[float, float]:
        """(forward, backward) with the exposed exchanges: TP's 0.4 : 0.6, CP's 1 : 2 (K/V forward; K/V and their
        gradients backward)."""
        return (self.forward + 0.4 * self.tp_exposed + self.cp_exposed / 3,
                self.backward + 0.6 * self.tp_exposed + 2 * self.cp_exposed / 3)


def collective_s(op: str, payload: float, n: int, link: Link) -> float:
    """A ring collective's seconds: hop latencies plus wire bytes (nccl-tests' bus factor) over the link."""
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * link.latency + factor * payload / link.busbw


def gemm_s(flops: float, dev: Device) -> float:
    return flops / (dev.peak * dev.gemm)


def attention_s(m: Micro, shape: Shape, dev: Device, kernel: str) -> float:
    """One layer's attention core forward on one rank (see the module doc)."""
    if kernel == "flash":
        return 4 * (m.b * m.s * m.s / (2 * m.cp)) * shape.hidden / m.tp / (dev.peak * dev.attention)
    scores = m.b * (shape.heads / m.tp) * m.s * m.s / m.cp
    return gemm_s(4 * scores * (shape.hidden // shape.heads), dev) + UNFUSED_BYTES * scores / dev.hbm


def layer_pass(shape: Shape, m: Micro, dev: Device, recompute: str, overlap: str, tp_link: Link,
               kernel: str = "flash", cp_link: Optional[Link] = None) -> Pass:
    """One transformer layer's forward and backward on one rank (TP exchanges exposed as `overlap` leaves them, CP's
    ring over `cp_link` behind the attention blocks)."""
    h, t, d = shape.hidden, m.tokens, shape.hidden // shape.heads
    column = 2 * t * h * (h + 2 * shape.kv_heads * d + shape.mlp_in) / m.tp  # QKV and up projection, forward
    row = 2 * t * (h * h + shape.ffn * h) / m.tp  # attention output and down projection, forward
    attention = attention_s(m, shape, dev, kernel)
    elementwise = m.act * t * (ELEMENTWISE_PER_H * h / (m.tp if m.sp else 1) + 2 * shape.mlp_in / m.tp) / dev.hbm
    forward = gemm_s(column + row, dev) + attention + elementwise + KERNELS * dev.launch_s
    backward = 2 * (forward - attention) + (2.5 if kernel == "flash" else 2.0) * attention
    backward += forward if recompute == "full" else attention if recompute == "selective" else 0.0
    gemms, rerun = (gemm_s(column, dev), gemm_s(row, dev)), 1 + (recompute == "full") / 2
    exposed, total = (tp_exposed(shape, m, dev, mode, tp_link, gemms) for mode in (overlap, "none"))
    ring = cp_ring(shape, m, attention, cp_link or tp_link)
    return Pass(forward, backward, exposed * rerun, total * rerun, ring[0] * rerun, ring[1] * rerun)


def cp_ring(shape: Shape, m: Micro, attention: float, link: Link) -> tuple[float, float]:
    """(exposed, total) seconds of a layer's CP ring: forward cp − 1 hops of this rank's K and V, each behind one
    block of the attention (1/cp of it); backward the same hops with K/V's gradients too (twice the bytes) behind
    the backward's blocks (2.5× the forward's)."""
    if m.cp == 1:
        return 0.0, 0.0
    kv = 2 * m.tokens * shape.kv_heads * (shape.hidden // shape.heads) // m.tp * m.act
    hop = link.latency + kv / link.busbw
    block = attention / m.cp
    exposed = max(0.0, hop - block) + max(0.0, 2 * hop - 2.5 * block)
    return (m.cp - 1) * exposed, (m.cp - 1) * 3 * hop


def tp_exposed(shape: Shape, m: Micro, dev: Device, overlap: str, link: Link, gemms: tuple[float, float]) -> float:
    """A layer's TP exchange seconds left exposed, forward and backward: under SP two all-gathers and two
    reduce-scatters of the residual stream each way plus two regathers backward (without SP four all-reduces);
    bulk hides the backward's column exchanges behind its gradient GEMMs, chunked the forward's and the row
    layers' backward gathers behind theirs."""
    if m.tp == 1:
        return 0.0
    payload = m.tokens * shape.hidden * m.act
    if not m.sp:
        one = collective_s("all_reduce", payload, m.tp, link)
        hidden_bwd = min(2 * one, gemms[0] * 2) if overlap != "none" else 0.0
        return 4 * one - hidden_bwd
    one = collective_s("all_gather", payload, m.tp, link)
    forward, backward = 4 * one, 6 * one
    if overlap in ("bulk", "chunked"):  # regather ‖ input-gradient GEMM, reduce-scatter ‖ weight-gradient GEMM
        backward -= 2 * min(2 * one, gemms[0])
    if overlap == "chunked":  # forward all-gathers ‖ column GEMMs, reduce-scatters ‖ row GEMMs; row backward gathers
        forward -= min(2 * one, gemms[0]) + min(2 * one, gemms[1])
        backward -= min(2 * one, 2 * gemms[1])
    return forward + backward


def head_pass(shape: Shape, m: Micro, dev: Device, tp_link: Link) -> Pass:
    """The last stage's extra work per microbatch: the head's GEMM over the (padded) vocabulary, the loss's
    elementwise passes over the logits, its TP exchanges (the input's gather, three small all-reduces)."""
    t, v = m.tokens, shape.vocab / m.tp
    gemm = gemm_s(2 * t * shape.hidden * v, dev)
    logits = 6 * t * v * 4 / dev.hbm  # fp32 logits written, softmaxed and their gradient: a few passes
    exchange = collective_s("all_gather", t * shape.hidden * m.act, m.tp, tp_link) * 3
    exchange += 3 * collective_s("all_reduce", t * 4, m.tp, tp_link)
    return Pass(gemm + logits / 2, 2 * gemm + logits / 2, exchange, exchange)


def embed_pass(shape: Shape, m: Micro, dev: Device, tp_link: Link) -> Pass:
    """The first stage's extra work per microbatch: the token embedding's gather (read and written), its TP
    exchange (the vocabulary-parallel lookup's all-reduce, a reduce-scatter under SP), the gradient's scatter-add
    into the fp32 table backward."""
    t, h = m.tokens, shape.hidden
    exchange = collective_s("reduce_scatter" if m.sp else "all_reduce", t * h * m.act, m.tp, tp_link)
    return Pass(2 * t * h * m.act / dev.hbm + 2 * dev.launch_s, 3 * t * h * 4 / dev.hbm + 2 * dev.launch_s,
                exchange, exchange)


def p2p_s(m: Micro, hidden: int, link: Link) -> float:
    """One microbatch's hidden states (or their gradient) between two pipeline stages."""
    payload = m.tokens * hidden * m.act / (m.tp if m.sp and m.tp > 1 else 1)
    return link.latency + payload / link.busbw


def optimizer_s(elements: float, dev: Device) -> float:
    """Adam over `elements` parameters: fp32 weight, gradient, two moments read and written, the bf16 copy written
    (about 34 bytes an element), memory-bound — at the device's optimizer rate where calibrated, else its memory
    bandwidth."""
    return OPTIMIZER_BYTES * elements / (dev.optimizer_bw or dev.hbm)
