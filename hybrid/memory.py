"""The memory estimate: what one rank will hold, before anything is allocated.

Per rank, in bytes (docs/memory.md has the derivations):

- **parameters**: this rank's chunks (TP shard, stage, the tied head's copy on the last stage), fp32;
- **gradients**: the DP buckets (fp32, padded to dp shards under `parallel.zero=1`);
- **optimizer**: the optimizer's fp32 state (AdamW's two moments, SGD's momentum) — of the whole rank's
  parameters, or of its 1/dp shard under ZeRO-1; a replica sync mode's own (DiLoCo's anchors and momentum;
  none on a parameter-server worker: `hybrid.sync.footprint`);
- **activations**: what autograd keeps for the backward (`layer_activation_bytes` per layer and
  microbatch, `ends_bytes` for the embedding and the head), times the microbatches a rank holds at once
  under its schedule (`held_bytes` replays the rank's compute order: 1F1B keeps up to pp on the first
  stage, interleaved more, GPipe all of them; a split backward also what its input pass keeps for the
  weight pass, `weight_pass_bytes`);
- **buffers**: what a step allocates beyond that, at its peak: the backward's transients (the larger of a
  layer's gradients, about the size of its activations, with those activations again under full
  recomputation, and the head's logits-sized temporaries on the last stage), plus the DP exchange's copies
  in flight (or a sync mode's exchange buffers) beyond the activations freed meanwhile; plus the codecs'
  state kept across steps (residuals, working buffers) and a parameter server's shard on its host (CPU).

The parameter counts come from the rank's real chunks (built on the meta device by the caller), so every
family and layout is counted as it is built; the activation terms follow the ops hybrid runs, per kernel and
`train.recompute` mode (docs/memory.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from hybrid.config import optimizer_moments
from hybrid.model.family import family_of, ffn_hidden, kv_heads
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.buckets import assign_buckets, padded_numel
from hybrid.parallel.pp.actions import Op
from hybrid.parallel.pp.schedules import SCHEDULES, Schedule, ScheduleError, build_schedule, most_waiting
from hybrid.parallel.tp.fused_head import head_chunk
from hybrid.record.metrics import format_bytes
from hybrid.sync import mode_footprint
from hybrid.sync.exchange import exchange_bytes

if TYPE_CHECKING:
    from hybrid.config import Config, ModelConfig

F32 = 4
PARTS = ("params", "grads", "optimizer", "activations", "buffers")
Build = Callable[[ParallelContext], nn.ModuleList]
"""Builds a rank's model chunks from its (shape-only) context: `lambda ctx: build_chunks(cfg, vocab, ctx)`."""


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
    """What attention keeps. A fused kernel: q, k, v (views of the projection's output, or the rotated q and
    k), its output and the log-sum-exp. The math kernel (dropout on CPU): its own copies of q, k and v
    (scaled, expanded to every head), three b·a·s² tensors (softmax, dropout mask, dropped) and a copy of its
    output (the output projection's input). Selective recomputation: q, k, v (the recomputation's inputs)
    and the output."""
    heads, d, kv, full = cfg.n_heads // m.tp, cfg.hidden // cfg.n_heads, kv_heads(cfg) // m.tp, m.b * m.s
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


def loss_columns(chunk: nn.Module, tp: int) -> int:
    """The logits' columns the loss works on here: the real vocabulary at tp=1 (the padding sliced off), this
    rank's shard of the padded vocabulary under TP."""
    return chunk.vocab_size if tp == 1 else chunk.padded_vocab // tp


def held_bytes(schedule: Schedule, rank: int, per_chunk: Sequence[int],
               split: Sequence[Optional[tuple[int, int]]] = ()) -> int:
    """The most activation bytes `rank` holds at once: its compute order replayed, each forward of chunk c adding
    `per_chunk[c]` until that microbatch's backward (B), or under a split backward (`split[c]` = (what the
    weight pass reads, the gradients kept for it), `weight_pass_bytes`; None on the first part, whose input
    pass does nothing): from the input pass I on only those two, until the weight pass W."""
    kept = list(split) or [None] * len(per_chunk)
    change = {Op.FORWARD: lambda c: per_chunk[c], Op.FULL_BACKWARD: lambda c: -per_chunk[c],
              Op.BACKWARD_INPUT: lambda c: 0 if kept[c] is None else sum(kept[c]) - per_chunk[c],
              Op.BACKWARD_WEIGHT: lambda c: -per_chunk[c] if kept[c] is None else -sum(kept[c])}
    live = peak = 0
    for a in (a for a in schedule.actions[rank] if a.op in change):
        if a.op is Op.BACKWARD_INPUT and kept[a.chunk]:  # its gradients come while every box still holds
            peak = max(peak, live + kept[a.chunk][1])
        live += change[a.op](a.chunk)
        peak = max(peak, live)
    return peak


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


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimate, in bytes."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def micro_of(cfg: Config, device_type: str = "cpu", micro_batch: int | None = None) -> Micro:
    """`cfg`'s microbatch (or one of `micro_batch` sequences; a CP rank's seq_len / cp tokens) on `device_type`."""
    t, p = cfg.train, cfg.parallel
    return Micro(micro_batch or t.micro_batch_size, cfg.data.seq_len // p.cp, p.tp, p.sequence_parallel,
                 cfg.model.dropout, t.recompute, device_type, 2 if t.precision == "bf16_params" else F32,
                 head_chunk(t.fused_head, t.head_chunk, device_type))


def rank_memory(cfg: Config, chunks: nn.ModuleList, schedule: Schedule, pp_rank: int, dp: int, m: Micro,
                share: int = 1, host: bool = True) -> RankMemory:
    """The estimate of a rank holding `chunks` (its model parts, e.g. built on the meta device) at pipeline
    rank `pp_rank` of `schedule`, in a DP group of `dp` with `share` of them on its node, microbatches `m`;
    `host`: it hosts a parameter-server shard (sync=ps, as DP rank 0 does)."""
    params = [p for p in chunks.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    buckets = assign_buckets(params, int(cfg.parallel.bucket_mb * 2**20))
    sizes = [sum(p.numel() for p in b) for b in buckets]
    if cfg.parallel.zero == 1:
        sizes = [padded_numel(n, dp) for n in sizes]
    low = cfg.train.precision == "bf16_params"  # bf16 parameters; fp32 main weights beside the moments
    grads = F32 * sum(sizes)
    held = sum(sizes) // dp if cfg.parallel.zero == 1 else numel  # elements whose optimizer state is here
    optimizer = (optimizer_moments(cfg.optim) + low) * F32 * held
    per_chunk, kept = [], []
    for chunk in chunks:
        layers, vocab = len(chunk.layers), loss_columns(chunk, m.tp)
        per_chunk.append(layers * layer_activation_bytes(cfg.model, m)
                         + ends_bytes(cfg.model, m, vocab, chunk.pre, chunk.post))
        kept.append(weight_pass_bytes(cfg.model, m, layers, vocab, chunk.pre, chunk.post))
    activations = held_bytes(schedule, pp_rank, per_chunk, kept)
    logits_grad = head_transient(cfg.model, m, loss_columns(chunks[-1], m.tp)) if any(c.post for c in chunks) else 0
    # a layer's backward: gradients about the size of its activations and, under full recomputation, those too
    rerun = Micro(m.b, m.s, m.tp, m.sp, m.dropout, "none", m.device, m.act)
    transient = max(logits_grad, (1 + (m.recompute == "full")) * layer_activation_bytes(cfg.model, rerun))
    codec = lambda n, group: exchange_bytes(cfg, [n], group, m.device)[1]  # noqa: E731 - an outer hook's state
    optimizer, copies, state = mode_footprint(cfg, params, sizes, dp, share, m.device, host).terms(optimizer, codec)
    # the exchange's copies grow in the backward as the activations are freed: what exceeds them adds
    buffers = transient + max(0, copies - activations) + state
    return RankMemory((2 if low else F32) * numel, grads, optimizer, activations, buffers)


def meta_stages(layout: Layout, build: Build) -> list[nn.ModuleList]:
    """Each pipeline stage's first rank's chunks, `build(ctx)` on the meta device (no memory, no processes)."""
    out = []
    for pp_rank in range(layout.pp):
        with torch.device("meta"):
            out.append(build(ParallelContext.shapes(layout, layout.rank(pp_rank, 0, 0))))
    return out


def stage_estimates(cfg: Config, layout: Layout, stages: Sequence[nn.ModuleList], device_type: str,
                    micro_batch: int | None = None) -> list[RankMemory]:
    """The estimate of each stage's rank holding `stages[pp_rank]` (`micro_batch`: instead of
    `train.micro_batch_size`)."""
    m = micro_of(cfg, device_type, micro_batch)
    schedule = training_schedule(cfg, layout, stages, m)
    return [rank_memory(cfg, chunks, schedule, r, layout.dp, m, layout.dp_per_node) for r, chunks in enumerate(stages)]


def training_schedule(cfg: Config, layout: Layout, stages: Sequence[nn.ModuleList], m: Micro) -> Schedule:
    """The schedule the run's ranks follow: `parallel.schedule` (1f1b at pp=1); a zero-bubble one under
    `parallel.zb_memory=1f1b` with each rank's weight-pass deferrals fitted to its unsplit memory (for zb1p:
    1F1B's; `weight_deferrals`)."""
    p, count = cfg.parallel, cfg.train.global_batch_size // (m.b * layout.dp)
    name = p.schedule if layout.pp > 1 else "1f1b"
    if not SCHEDULES[name].split_backward or p.zb_memory == "none":
        return build_schedule(name, layout.pp, count, p.virtual_stages)
    return build_schedule(name, layout.pp, count, p.virtual_stages,
                          deferrals=weight_deferrals(cfg, layout, stages, m, count))


def weight_deferrals(cfg: Config, layout: Layout, stages: Sequence[nn.ModuleList], m: Micro, count: int
                     ) -> tuple[Optional[int], ...]:
    """Per pipeline rank the most weight passes (up to the schedule's own) it may leave waiting while its estimate
    stays within the largest rank's with every backward unsplit (zb1p: 1F1B; zbv: its V), or None (unsplit) where
    even running each at once would not: a waiting microbatch can hold more than its activations."""
    def totals(deferrals: list[Optional[int]]) -> list[int]:
        schedule = build_schedule(name, layout.pp, count, v, deferrals=deferrals, comm=False)
        return [rank_memory(cfg, c, schedule, r, layout.dp, m, layout.dp_per_node).total for r, c in enumerate(stages)]

    name, v = cfg.parallel.schedule, cfg.parallel.virtual_stages
    own = [most_waiting(a) for a in build_schedule(name, layout.pp, count, v, comm=False).actions]
    limit, best = max(totals([None] * layout.pp)), [None] * layout.pp
    for d in range(max(own) + 1):
        fits = totals([min(d, k) for k in own])
        best = [min(d, k) if total <= limit else b for total, k, b in zip(fits, own, best)]
    return tuple(best)


def largest_micro_batch(cfg: Config, layout: Layout, stages: Sequence[nn.ModuleList], device_type: str,
                        memory: int) -> int:
    """The largest micro batch (dividing global batch / dp) whose largest stage fits `memory`; 0 if none."""
    per_dp = cfg.train.global_batch_size // layout.dp
    best = 0
    for b in (b for b in range(1, per_dp + 1) if per_dp % b == 0):
        try:
            estimates = stage_estimates(cfg, layout, stages, device_type, b)
        except ScheduleError:  # too few microbatches for the schedule (interleaved)
            break
        if max(e.total for e in estimates) > memory:
            break
        best = b
    return best


def default_memory(device_type: str, ranks_per_node: int) -> int:
    """The GPU's memory, or this machine's MemTotal shared by the ranks of one node."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, ranks_per_node)


def summary(cfg: Config, layout: Layout, build: Build, device_type: str, memory: int) -> str:
    """One line: the largest stage's estimate, its parts, the verdict against `memory`, the largest micro batch."""
    chunks = meta_stages(layout, build)
    stages = stage_estimates(cfg, layout, chunks, device_type)
    worst = max(stages, key=lambda e: e.total)
    largest = largest_micro_batch(cfg, layout, chunks, device_type, memory)
    parts = ", ".join(f"{name} {format_bytes(getattr(worst, name))}" for name in PARTS)
    verdict = "fits" if worst.total <= memory else "does not fit"
    return (f"memory estimate per rank (largest of {len(stages)} stage(s)): {format_bytes(worst.total)} ({parts}); "
            f"{verdict} in {format_bytes(memory)}; largest micro batch that fits: {largest or 'none'}")
