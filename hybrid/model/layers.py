"""Transformer blocks shared by every model family, built from TP layers.

Each block takes resolved choices (`Norm(rms=...)`, `MLP(kind=...)`, `Attention(bias=...)`,
learned or rotary positions in `CausalLM`): the family's `Blocks` record, asked once by
`CausalLM` (`family_of(cfg)`), decides them; nothing here compares family names.

Attention: one column-parallel QKV projection whose global rows are [Q heads | K heads |
V heads]; each TP rank holds whole heads of each part (and whole KV heads under GQA), so
`scaled_dot_product_attention` runs locally; the output projection is row-parallel. MLP:
column-parallel up (fc1, or SwiGLU's fused gate|up) then row-parallel down. Norms are
replicated on every TP rank (their gradients are identical there). Per layer and
microbatch this is two all-reduces forward and two backward over the TP group.

With sequence parallelism (`sequence_parallel=True`, tp > 1) the residual stream between the
TP regions is this rank's [b, s/tp, h] chunk: norms and dropout run on the chunk, each
column-parallel layer all-gathers it, each row-parallel layer reduce-scatters into it (two
all-gathers and two reduce-scatters per layer forward, the same backward, plus Megatron's
re-gather of the column layers' inputs). The head gathers the sequence before the logits.

Dropout inside TP regions (attention probabilities) and on sequence chunks draws from the
TP rank's own stream (`hybrid.parallel.rng.TPRandom`); replicated activations draw from the
default generator, identical on every TP rank.

The head computes the loss either from the vocab-split logits (`vocab_parallel_cross_entropy`) or, with
`set_fused_head` (`train.fused_head`), fused with its linear a chunk of tokens at a time
(`hybrid.parallel.tp.fused_head`: neither the whole logits nor their gradient ever exist).

`CausalLM` holds a contiguous range of layers with their *global* indices as names
(`layers.17.attn.qkv.weight`), plus the embedding on the first stage and the final norm and
head on the last, so a pipeline stage builds only its own part.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.model.context_parallel import ContextParallel
from hybrid.model.family import Blocks, family_of
from hybrid.model.rope import apply_rope, rope_tables
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.params import Init, annotate, init_parameters, param_info
from hybrid.parallel.recompute import recompute
from hybrid.parallel.rng import TPRandom, derive_seed
from hybrid.parallel.tp.comm import TPOverlap
from hybrid.parallel.tp.fused_head import MODES, fused_linear_cross_entropy, head_chunk
from hybrid.parallel.tp.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_linear,
    padded_vocab,
    vocab_parallel_cross_entropy,
)

if TYPE_CHECKING:
    from hybrid.config import ModelConfig


class Norm(nn.Module):
    """LayerNorm (weight, bias) or, with `rms`, RMSNorm (weight); replicated across TP ranks (on
    sequence chunks under SP)."""

    def __init__(self, hidden: int, eps: float, rms: bool, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps, self.rms = eps, rms
        sp = sequence_parallel
        self.weight = annotate(nn.Parameter(torch.empty(hidden)), Init("ones"), sequence_parallel=sp)
        self.bias = None if rms else annotate(nn.Parameter(torch.empty(hidden)), Init("zeros"), sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Attention(nn.Module):
    """Causal self-attention with heads (and KV heads) split across the TP group; `bias` on both projections."""

    def __init__(self, cfg: ModelConfig, group: Group, out_std: float, sp: bool, rng: TPRandom, bias: bool) -> None:
        super().__init__()
        tp = C.size(group)
        self.head_dim = cfg.hidden // cfg.n_heads
        self.n_heads = cfg.n_heads // tp
        self.n_kv = (cfg.n_kv_heads or cfg.n_heads) // tp
        self.dropout, self.rng = cfg.dropout, rng
        self.recompute_core = False  # selective recomputation: the attention core rerun in the backward
        self.cp: Optional[ContextParallel] = None  # context parallelism: attention over every CP rank's tokens
        q, kv = cfg.n_heads * self.head_dim, (cfg.n_kv_heads or cfg.n_heads) * self.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden, (q, kv, kv), group, bias=bias, std=cfg.init_std,
                                        sequence_parallel=sp)
        self.proj = RowParallelLinear(cfg.n_heads * self.head_dim, cfg.hidden, group, bias=bias, std=out_std,
                                      sequence_parallel=sp)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, local q|k|v] (the whole sequence, also under SP)
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim,
                             self.n_kv * self.head_dim], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][:s].to(q.dtype), rope[1][:s].to(q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rerun = self.recompute_core and torch.is_grad_enabled()
        y = recompute(self.core, [self.rng], q, k, v) if rerun else self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ/√d + causal mask) v, with dropout on the probabilities from this TP rank's stream."""
        p = self.dropout if self.training else 0.0
        with self.rng.fork(q.device) if p > 0 else contextlib.nullcontext():  # this rank's heads: own masks
            if self.cp is not None:
                return self.cp.attend(q, k, v, p)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                                  enable_gqa=self.n_kv != self.n_heads)


class MLP(nn.Module):
    """kind "gelu": fc1 → GELU(tanh) → fc2. kind "swiglu": fused gate|up → SiLU(gate)·up → down."""

    def __init__(self, cfg: ModelConfig, group: Group, out_std: float, sp: bool, kind: str, bias: bool) -> None:
        super().__init__()
        self.swiglu = kind == "swiglu"
        self.recompute_act = False  # selective recomputation: keep the activation's input, not its output
        ffn = cfg.ffn_hidden or 4 * cfg.hidden
        parts = (ffn, ffn) if self.swiglu else (ffn,)
        self.up = ColumnParallelLinear(cfg.hidden, parts, group, bias=bias, std=cfg.init_std, sequence_parallel=sp)
        self.down = RowParallelLinear(ffn, cfg.hidden, group, bias=bias, std=out_std, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h, self.act) if self.recompute_act else self.down(self.act(h))

    def act(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    Residual dropout runs on the replicated stream (default generator, the same mask on every
    TP rank) or, under sequence parallelism, on this rank's chunk (the TP rank's own stream).
    """

    def __init__(self, cfg: ModelConfig, choices: Blocks, group: Group, sp: bool, rng: TPRandom) -> None:
        super().__init__()
        rms = choices.norm == "rms"
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.sp, self.rng = sp, rng
        self.attn_norm = Norm(cfg.hidden, cfg.norm_eps, rms, sp)
        self.attn = Attention(cfg, group, out_std, sp, rng, bias=choices.bias)
        self.mlp_norm = Norm(cfg.hidden, cfg.norm_eps, rms, sp)
        self.mlp = MLP(cfg, group, out_std, sp, kind=choices.mlp, bias=choices.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute_full = False  # full recomputation: only the block's input is kept for the backward
        self.compiled: Optional[Callable[..., torch.Tensor]] = None  # `run` through torch.compile (train.compile)

    def set_recompute(self, mode: str) -> None:
        """none | selective (the attention core and the MLP activation) | full (the whole block)."""
        self.recompute_full = mode == "full"
        self.attn.recompute_core = self.mlp.recompute_act = mode == "selective"

    def set_compile(self, on: bool, mode: Optional[str] = None) -> None:
        """Run the block through `torch.compile` in `mode` (torch's; compiled on its first call; inductor on CPU
        needs a C++ compiler). Recomputation composes: it reruns the compiled block."""
        self.compiled = torch.compile(self.run, mode=mode) if on else None

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout.p > 0):
            return x
        with self.rng.fork(x.device) if self.sp else contextlib.nullcontext():
            return self.dropout(x)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        run = self.compiled or self.run
        if self.recompute_full and torch.is_grad_enabled():
            return recompute(lambda y, *r: run(y, r or None), [self.rng], x, *(rope or ()))
        return run(x, rope)

    def run(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self._drop(self.attn(self.attn_norm(x), rope))
        return x + self._drop(self.mlp(self.mlp_norm(x)))


class CausalLM(nn.Module):
    """A decoder-only LM, or the part of it one pipeline stage holds.

    `layers` is the range of global layer indices built here; `pre` adds the embeddings,
    `post` the final norm, head and loss. `vocab_size` is the real vocabulary (the
    tokenizer's); the embedding is padded beyond it and padded logits never reach the loss.
    With `sequence_parallel` (and tp > 1) hidden states between stages and layers are this TP
    rank's sequence chunk [b, s/tp, h]; ids, labels and logits cover the whole sequence.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, tp_group: Group = None, layers: Optional[range] = None,
                 pre: bool = True, post: bool = True, seed: int = 0, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.tp_group, self.pre, self.post = cfg, tp_group, pre, post
        self.vocab_size = vocab_size
        tp = C.size(tp_group)
        self.padded_vocab = padded_vocab(vocab_size, cfg.make_vocab_size_divisible_by, tp)
        self.layer_ids = layers if layers is not None else range(cfg.n_layers)
        self.choices = choices = family_of(cfg).blocks  # the family, asked once
        self.learned_positions = choices.positions == "learned"
        self.sp = sp = sequence_parallel and tp > 1
        self.rng = TPRandom(derive_seed(seed, "dropout", C.rank(tp_group), self.layer_ids.start))
        if pre:
            self.tok_embed = VocabParallelEmbedding(self.padded_vocab, cfg.hidden, tp_group, cfg.init_std, sp)
            if self.learned_positions:
                self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden)
                annotate(self.pos_embed.weight, Init("normal", cfg.init_std), sequence_parallel=sp)
        self.layers = nn.ModuleDict({str(i): Block(cfg, choices, tp_group, sp, self.rng) for i in self.layer_ids})
        if choices.positions == "rope":
            head_dim = cfg.hidden // cfg.n_heads
            cos, sin = rope_tables(head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if post:
            self.norm = Norm(cfg.hidden, cfg.norm_eps, choices.norm == "rms", sp)
            if not (cfg.tie_embeddings and pre):
                self.head = ColumnParallelLinear(cfg.hidden, (self.padded_vocab,), tp_group, bias=False,
                                                 std=cfg.init_std, sequence_parallel=sp)
        self.fused_head = ("off", 0)  # `set_fused_head`: (train.fused_head, train.head_chunk)
        self.compiled: Optional[Callable[..., torch.Tensor]] = None  # `run` through torch.compile (scope model)
        self.cp: Optional[ContextParallel] = None  # `set_context_parallel`
        self.tp_overlap = TPOverlap()  # `set_tp_overlap`
        self._mark_pipeline_tied()
        tied_head = {"head.weight": "tok_embed.weight"} if cfg.tie_embeddings else {}
        init_parameters(self, seed, {tied_head.get(n, n): p for n, p in self.named_parameters()})

    def _mark_pipeline_tied(self) -> None:
        """A tied embedding split between the first stage (token embedding) and the last (head):
        both copies are `pp_tied` (their gradients are summed over the embedding group), the
        last stage's is the `pp_duplicate` (counted once in norms and parameter counts). The head
        is initialised from the embedding's global name, so both start identical."""
        if not self.cfg.tie_embeddings or (self.pre and self.post):
            return
        if self.pre:
            param_info(self.tok_embed.weight).pp_tied = True
        if self.post:
            info = param_info(self.head.weight)
            info.pp_tied = info.pp_duplicate = True

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation of every block here: none | selective | full (`train.recompute`)."""
        for layer in self.layers.values():
            layer.set_recompute(mode)

    def set_compile(self, on: bool, scope: str = "blocks", mode: str = "default") -> None:
        """`torch.compile` each block here, or this whole part's forward (`scope` model: embeddings, blocks, head
        and loss in one graph where nothing breaks it, fused across the blocks' edges), in torch's `mode`
        (`train.compile`, `train.compile_scope`, `train.compile_mode`; reduce-overhead adds CUDA graphs)."""
        torch_mode = None if mode == "default" else mode
        for layer in self.layers.values():
            layer.set_compile(on and scope == "blocks", torch_mode)
        self.compiled = torch.compile(self.run, mode=torch_mode) if on and scope == "model" else None

    def set_context_parallel(self, cp: Optional[ContextParallel]) -> None:
        """This part's tokens are a CP rank's load-balanced share of each sequence (`parallel.cp` > 1); its TP
        stream becomes the CP rank's own (once: call it once), as its tokens' masks must differ from its peers'."""
        self.cp = cp
        self.rng.seed = cp.stream_seed(self.rng.seed) if cp is not None else self.rng.seed
        for layer in self.layers.values():
            layer.attn.cp = cp

    def set_fused_head(self, mode: str, chunk: int = 4096) -> None:
        """The loss through the fused head (`hybrid.parallel.tp.fused_head`, `chunk` tokens at a time): on, off,
        or auto — on when the input is on CUDA (`train.fused_head`, `train.head_chunk`). Logits stay unfused."""
        if mode not in MODES or chunk < 1:
            raise ValueError(f"fused head {mode!r} with chunks of {chunk} tokens: want one of {MODES}, chunk >= 1")
        self.fused_head = (mode, chunk)

    def set_tp_overlap(self, overlap: TPOverlap) -> None:
        """How every TP layer here (and the head's logits) overlaps its exchanges with its GEMMs: none, bulk or
        chunked (`parallel.tp_overlap`; `hybrid.parallel.tp.overlap`)."""
        self.tp_overlap = overlap
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                m.overlap = overlap

    def head_weight(self) -> torch.Tensor:
        return self.tok_embed.weight if hasattr(self, "tok_embed") and not hasattr(self, "head") else self.head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token (+ position) embeddings: [b, s, h], or this rank's [b, s/tp, h] chunk under SP."""
        x = self.tok_embed(ids)
        if self.learned_positions:
            positions = self._positions(ids.shape[1], ids.device)
            if self.sp:
                positions = C.split_seq(positions.unsqueeze(0), self.tp_group).squeeze(0).clone()  # its own s/tp
            x = x + self.pos_embed(positions)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-split logits [b, s, padded_vocab / tp] over the whole sequence (the head is
        column-parallel: all-reduce of dx backward, or all-gather of the chunks under SP)."""
        return column_linear(self.norm(x), self.head_weight(), None, self.tp_group, self.sp, self.tp_overlap)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids (first stage) or hidden states in; hidden states, logits, or the mean loss out."""
        return (self.compiled or self.run)(x, labels)

    def _positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The whole-sequence index of each of this rank's `local` tokens (under CP its two chunks')."""
        return torch.arange(local, device=device) if self.cp is None else self.cp.positions(local, device)

    def _rope(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """RoPE's tables for this rank's tokens: the first rows, or under CP the rows of its tokens' positions."""
        if self.choices.positions != "rope":
            return None
        if self.cp is None:
            return self.rope_cos, self.rope_sin
        at = self._positions(x.shape[1] * (C.size(self.tp_group) if self.sp and not self.pre else 1), x.device)
        return self.rope_cos[at], self.rope_sin[at]

    def run(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        rope = self._rope(x)
        if self.pre:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, rope)
        if not self.post:
            return x
        if labels is None:
            return self.logits(x)
        chunk = head_chunk(*self.fused_head, x.device.type)
        if chunk:  # the head and the loss fused, never the whole logits
            return fused_linear_cross_entropy(self.norm(x), self.head_weight(), labels, self.tp_group,
                                              self.vocab_size, chunk, self.sp)
        return vocab_parallel_cross_entropy(self.logits(x), labels, self.tp_group, self.vocab_size)

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Unpadded, TP-gathered logits [b, s, vocab] (evaluation and tests)."""
        return C.gather_from_region(self.forward(ids), self.tp_group)[..., : self.vocab_size]
