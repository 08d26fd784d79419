"""What one microbatch keeps and briefly allocates, per layer and at the model's ends: the activation terms of
the memory estimate (`hybrid.memory` adds them up per rank and schedule; docs/memory.md has the derivations).

Each term follows the ops hybrid runs, per attention kernel (fused, the CPU math kernel under dropout, a CP
exchange's), `train.recompute` mode, precision and fused head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from hybrid.model.family import family_of, ffn_hidden, kv_heads

if TYPE_CHECKING:
    from hybrid.config import ModelConfig

F32 = 4


@dataclass(frozen=True)
class Micro:
    """One microbatch as a rank sees it: b sequences of s tokens, tp ranks, sequence parallelism, dropout,
    recomputation, and the device type (CUDA: fused attention with dropout too, byte dropout masks)."""

    b: int
    s: int
    tp: int = 1
    sp: bool = False
    dropout: float = 0.0
    recompute: str = "none"
    device: str = "cpu"
    act: int = F32  # bytes per activation element: 2 under bf16 parameters (`train.precision=bf16_params`)
    head_chunk: int = 0  # tokens per chunk of the fused head (`train.fused_head`), 0: the unfused head
    cp: int = 1  # context parallelism: `s` is a CP rank's share of the sequence, its attention `cp_comm`'s
    cp_comm: str = "ring"
    tp_chunked: bool = False  # `parallel.tp_overlap=chunked` (under SP): pieces of the sequence in flight

    @property
    def fused_attention(self) -> bool:
        """A fused attention kernel (flash / memory-efficient): always on CUDA, without dropout on CPU."""
        return self.device == "cuda" or self.dropout == 0

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a dropout mask: bool on CUDA, the input's float on CPU."""
        return 1 if self.device == "cuda" else self.act

    @property
    def s_local(self) -> int:
        """The sequence length of the residual stream here (s/tp under sequence parallelism)."""
        return self.s // self.tp if self.sp and self.tp > 1 else self.s


def norm_bytes(rms: bool, tokens: int, h: int, act: int = F32) -> int:
    """A norm's input, its statistics and its output (kept by the linear that follows), activations of `act`
    bytes. RMSNorm (composite on CPU) computes in fp32: an fp32 copy of its input, rstd and the normalised
    tensor, then its output in the activations' dtype; LayerNorm keeps all in the activations' dtype."""
    if rms:
        return F32 * (2 * tokens * h + tokens) + act * tokens * h
    return act * (2 * tokens * h + 2 * tokens)


def attention_bytes(cfg: ModelConfig, m: Micro) -> int:
    """What attention keeps, by kernel (CP's exchanges: `cp_attention_bytes`). A fused kernel: q, k, v (views of
    the projection's output, or the rotated q and k), its output and the log-sum-exp. The math kernel (dropout
    on CPU): its own copies of q, k and v (scaled, expanded to every head), three b·a·s² tensors (softmax,
    dropout mask, dropped) and a copy of its output (the output projection's input). Selective recomputation:
    q, k, v (the recomputation's inputs) and the output."""
    if m.cp > 1:
        return cp_attention_bytes(cfg, m)
    return _local_attention_bytes(cfg, m, cfg.n_heads // m.tp, kv_heads(cfg) // m.tp)


def cp_attention_bytes(cfg: ModelConfig, m: Micro) -> int:
    """Under context parallelism. The ring keeps what a fused kernel does (q, k, v, output, log-sum-exp), its
    merged output in fp32 beside the output in bf16, and no s² term with dropout either: its blocks draw their
    masks again. The all-to-all runs the local kernel over cp times the tokens and 1/cp of the heads (K/V heads
    repeated when they do not divide), and keeps one more output: the one brought back to the local tokens."""
    heads, d, kv, full = cfg.n_heads // m.tp, cfg.hidden // cfg.n_heads, kv_heads(cfg) // m.tp, m.b * m.s
    if m.cp_comm == "a2a":
        whole = Micro(m.b, m.s * m.cp, m.tp, m.sp, m.dropout, m.recompute, m.device, m.act)
        moved = kv // m.cp if kv % m.cp == 0 else heads // m.cp
        return _local_attention_bytes(cfg, whole, heads // m.cp, moved) + m.act * full * heads * d
    ring = Micro(m.b, m.s, m.tp, m.sp, 0.0, m.recompute, m.device, m.act)
    merged = F32 * full * heads * d if m.act != F32 and m.recompute != "selective" else 0
    return _local_attention_bytes(cfg, ring, heads, kv) + merged


def ring_transient(cfg: ModelConfig, m: Micro) -> int:
    """What the ring's backward allocates beyond the layer's gradients (`cp_comm=ring`): dq and the rank's own
    dK/dV in fp32, a block's dK/dV being summed and the previous rank's arriving (fp32), the K/V block in hand
    and the next arriving."""
    if m.cp == 1 or m.cp_comm != "ring":
        return 0
    heads, d, kv, full = cfg.n_heads // m.tp, cfg.hidden // cfg.n_heads, kv_heads(cfg) // m.tp, m.b * m.s
    return F32 * full * d * (heads + 6 * kv) + m.act * 4 * full * kv * d


def tp_ring_transient(cfg: ModelConfig, m: Micro) -> int:
    """What the chunked TP overlap's rings hold beyond the blocking exchanges' tensors: an all-gather's piece in hand
    and the next arriving plus the GEMM's output for the piece in hand before it is copied into place (the widest:
    the MLP's up projection); a reduce-scatter's partial sum and the running sums sent and arriving — every piece
    of a rank's share of the sequence (b · s/tp tokens in all, whatever the chunk count)."""
    if not (m.tp_chunked and m.sp and m.tp > 1):
        return 0
    tokens, h = m.b * m.s // m.tp, cfg.hidden
    up = ffn_hidden(cfg) * (2 if family_of(cfg).blocks.mlp == "swiglu" else 1) // m.tp
    return m.act * tokens * max(2 * h + up, 3 * h)


def _local_attention_bytes(cfg: ModelConfig, m: Micro, heads: int, kv: int) -> int:
    """`attention_bytes` of one kernel over `m`'s tokens and `heads` query, `kv` K/V heads."""
    d, full = cfg.hidden // cfg.n_heads, m.b * m.s
    rope = family_of(cfg).blocks.positions == "rope"
    tables = 2 * m.s * d * m.act if rope and m.act != F32 else 0  # RoPE's fp32 tables cast to bf16, per layer
    if not m.fused_attention and m.recompute != "selective":
        if m.act == F32:
            return F32 * (4 * full * heads * d + 3 * m.b * heads * m.s * m.s)
        # bf16 on CPU: the math kernel upcasts (fp32 q, k, v and output, two fp32 s² tensors), output cast back
        return F32 * (4 * full * heads * d + 2 * m.b * heads * m.s * m.s) + m.act * full * heads * d + tables
    qkv = full * (heads + 2 * kv) * d + (full * (heads + kv) * d if rope else 0)
    lse = F32 * m.b * heads * m.s if m.recompute != "selective" else 0  # the log-sum-exp is fp32
    return m.act * (qkv + full * heads * d) + lse + tables


def layer_activation_bytes(cfg: ModelConfig, m: Micro) -> int:
    """Bytes one transformer layer keeps for the backward of one microbatch."""
    h, tokens, full = cfg.hidden, m.b * m.s_local, m.b * m.s
    if m.recompute == "full":
        return m.act * tokens * h
    blocks = family_of(cfg).blocks
    f, swiglu = ffn_hidden(cfg) // m.tp, blocks.mlp == "swiglu"
    kept = 2 * norm_bytes(blocks.norm == "rms", tokens, h, m.act)
    kept += attention_bytes(cfg, m) + m.act * full * (1 + swiglu) * f  # and the up projection's output
    kept += m.act * full * (1 + swiglu) * f if m.recompute != "selective" else 0  # the activation's outputs
    kept += 2 * tokens * h * m.mask_bytes if m.dropout > 0 else 0  # the residual dropout masks
    return kept


def ends_bytes(cfg: ModelConfig, m: Micro, vocab_local: int, first: bool, last: bool) -> int:
    """The embedding's (ids; under TP this rank's shifted ids and their mask; positions) and the head's (final
    norm, head input, the cross-entropy's probabilities, targets and, under TP, their mask) kept tensors for
    one microbatch. The fused head keeps, beside the norm's input and statistics, only its input's and weight's
    fp32 gradients (the whole sequence's and this rank's vocabulary rows)."""
    tokens, full, tp = m.b * m.s_local, m.b * m.s, m.tp > 1
    blocks = family_of(cfg).blocks
    kept = 0
    if first:
        kept += 9 * full if tp else 8 * m.b * (m.s + 1)  # the sample's ids (inputs and labels: one tensor)
        kept += 8 * m.s_local if blocks.positions == "learned" else 0
    if last and m.head_chunk:
        kept += norm_bytes(blocks.norm == "rms", tokens, cfg.hidden, m.act) - m.act * tokens * cfg.hidden
        kept += F32 * (full + vocab_local) * cfg.hidden
    elif last:
        kept += norm_bytes(blocks.norm == "rms", tokens, cfg.hidden, m.act)
        kept += F32 * full * vocab_local + 8 * full + (full if tp else F32)
    return kept


def weight_pass_bytes(cfg: ModelConfig, m: Micro, layers: int, vocab_local: int, first: bool, last: bool
                      ) -> Optional[tuple[int, int]]:
    """What a split backward holds of one microbatch between its input and weight pass (`parallel.pp.split_backward`
    frees the rest): (the weight nodes' inputs — each norm's input, each projection's input, on the last part
    the final norm's and the head's —, the gradient that flowed into each weight node — of each norm's and
    projection's output, on the last part the logits'). None on the first part: no input pass, its weight pass
    is its whole backward. Under full recomputation a block's weights get their gradients in the input pass.
    The fused head's node keeps its two fp32 gradients (as in the forward) and gets a scalar."""
    if first:
        return None
    h, tokens, full = cfg.hidden, m.b * m.s_local, m.b * m.s
    blocks = family_of(cfg).blocks
    heads, d, kv = cfg.n_heads // m.tp, h // cfg.n_heads, kv_heads(cfg) // m.tp
    f, swiglu = ffn_hidden(cfg) // m.tp, blocks.mlp == "swiglu"
    linear_in = tokens if m.sp and m.tp > 1 else full  # a sequence-parallel linear keeps its chunk
    reads = 2 * tokens * h + 2 * linear_in * h + full * (heads * d + f)
    grads = 2 * tokens * h + full * ((heads + 2 * kv) * d + h + (1 + swiglu) * f + h)
    per_layer = (0, 0) if m.recompute == "full" else (reads, grads)
    ends = (tokens * h + linear_in * h * (not m.head_chunk), tokens * h) if last else (0, 0)
    head = ((F32 * (full + vocab_local) * h, 0) if m.head_chunk else (0, F32 * full * vocab_local)) if last else (0, 0)
    return (m.act * (layers * per_layer[0] + ends[0]) + head[0], m.act * (layers * per_layer[1] + ends[1]) + head[1])


def head_transient(cfg: ModelConfig, m: Micro, vocab_local: int) -> int:
    """The head's temporaries beyond what it keeps. Unfused: its saved probabilities' size again, twice at tp=1
    (the logits' gradient and log-softmax's temporary), three times under TP (the forward's masked and shifted
    copies beside the logits and their exp). Fused, forward: a chunk's fp32 logits and, in bf16, the matmul's
    output and the gradient's cast, W's chunk gradient in bf16 and (CPU) its fp32 copy for the sum; backward: the
    kept gradients cast to bf16, at tp=1 W's padded to the padded vocabulary, under TP x's region copy."""
    full, cast, h, tp1 = m.b * m.s, m.act != F32, cfg.hidden, m.tp == 1
    if not m.head_chunk:
        return (3 if m.tp > 1 else 2) * F32 * full * vocab_local
    forward = min(m.head_chunk, full) * vocab_local * (F32 + 2 * m.act * cast)
    forward += cast * vocab_local * h * (m.act + F32 * (m.device == "cpu"))
    return max(forward, m.act * (vocab_local * h * (tp1 + cast) + full * h * (1 - tp1 + cast)))
