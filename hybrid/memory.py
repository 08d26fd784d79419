"""The memory estimate: what one rank will hold, before anything is allocated.

Per rank, in bytes (docs/memory.md has the derivations):

- **parameters**: this rank's chunks (TP shard, stage, the tied head's copy on the last stage), fp32;
- **gradients**: the DP buckets (fp32, padded to dp shards under `parallel.zero=1`; this rank's shards only under
  `parallel.zero=2`, whose microbatch rounds are buffers);
- **optimizer**: the optimizer's fp32 state (AdamW's two moments, SGD's momentum) — of the whole rank's
  parameters, or of its 1/dp shard under ZeRO-1 and 2; a replica sync mode's own (DiLoCo's anchors and momentum;
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from hybrid.config import optimizer_moments
from hybrid.memory_terms import (
    F32,
    Micro,
    ends_bytes,
    head_transient,
    layer_activation_bytes,
    ring_transient,
    tp_ring_transient,
    weight_pass_bytes,
)
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.buckets import assign_buckets, assign_units, padded_numel
from hybrid.parallel.dp.units import unit_groups, unit_params
from hybrid.parallel.pp.actions import Op
from hybrid.parallel.pp.schedules import SCHEDULES, Schedule, ScheduleError, build_schedule, most_waiting
from hybrid.parallel.tp.fused_head import head_chunk
from hybrid.record.metrics import format_bytes
from hybrid.sync import mode_footprint
from hybrid.sync.exchange import exchange_bytes
from hybrid.sync.zero import param_codec

if TYPE_CHECKING:
    from hybrid.config import Config

PARTS = ("params", "grads", "optimizer", "activations", "buffers")
Build = Callable[[ParallelContext], nn.ModuleList]
"""Builds a rank's model chunks from its (shape-only) context: `lambda ctx: build_chunks(cfg, vocab, ctx)`."""


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
                 head_chunk(t.fused_head, t.head_chunk, device_type), p.cp, p.cp_comm, p.tp_overlap == "chunked")


def rank_memory(cfg: Config, chunks: nn.ModuleList, schedule: Schedule, pp_rank: int, dp: int, m: Micro,
                share: int = 1, host: bool = True) -> RankMemory:
    """The estimate of a rank holding `chunks` (its model parts, e.g. built on the meta device) at pipeline
    rank `pp_rank` of `schedule`, in a DP group of `dp` with `share` of them on its node, microbatches `m`;
    `host`: it hosts a parameter-server shard (sync=ps, as DP rank 0 does)."""
    params = [p for p in chunks.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    zero, size = cfg.parallel.zero, int(cfg.parallel.bucket_mb * 2**20)
    buckets = assign_units(unit_params(chunks), size) if zero >= 1 else assign_buckets(params, size)
    sizes = [sum(p.numel() for p in b) for b in buckets]
    if zero >= 1:
        sizes = [padded_numel(n, dp) for n in sizes]
    low = cfg.train.precision == "bf16_params"  # bf16 parameters; fp32 main weights beside the moments
    itemsize = 2 if low else F32
    weights = itemsize * (sum(sizes) // dp if zero == 3 else numel)  # ZeRO-3 keeps this rank's shards only
    grads = F32 * sum(sizes) // (dp if zero >= 2 else 1)  # ZeRO-2 and 3 keep this rank's shards only
    held = sum(sizes) // dp if zero >= 1 else numel  # elements whose optimizer state is here
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
    rerun = replace(m, recompute="none", head_chunk=0)  # and the ring's dK/dV, K/V in flight
    layer = (1 + (m.recompute == "full")) * layer_activation_bytes(cfg.model, rerun) + ring_transient(cfg.model, m)
    layer += tp_ring_transient(cfg.model, m)  # the chunked TP overlap's pieces in flight
    transient = max(logits_grad, layer)
    codec = lambda n, group: exchange_bytes(cfg, [n], group, m.device)[1]  # noqa: E731 - an outer hook's state
    optimizer, copies, state = mode_footprint(cfg, params, sizes, dp, share, m.device, host).terms(optimizer, codec)
    # the exchange's copies grow in the backward as the activations are freed: what exceeds them adds; ZeRO-2's
    # microbatch rounds are there from the backward's first gradients on
    freed = activations if cfg.parallel.zero < 2 else 0
    gathered = itemsize * zero3_gathered(chunks, size, dp, m.device != "cuda") if zero == 3 else 0
    if zero == 3 and cfg.parallel.zero_hpz:  # hpZ: the step's secondary copy, 1/node of every unit
        gathered += itemsize * sum(sizes) // max(1, share)
    codec = param_codec(cfg) if zero == 3 else None
    if codec is not None:  # qwZ: each kept shard encoded, once a step
        gathered += sum(codec.encoded_bytes(codec.chunk_len(n // dp)) for n in sizes)
    buffers = transient + max(0, copies - freed) + state + gathered
    return RankMemory(weights, grads, optimizer, activations, buffers)


def zero3_gathered(chunks: nn.ModuleList, bucket_bytes: int, dp: int, gloo: bool) -> int:
    """Parameter elements ZeRO-3 holds gathered at once: every chunk's root (kept from its forward to its
    backward) and the two largest blocks (the one computing, the next prefetched), buckets padded; on CPU
    (`gloo`) a third, gloo's own output buffer of the all-gather in flight."""
    roots, blocks = [], []
    for root, ps in unit_groups(chunks):
        n = sum(padded_numel(sum(p.numel() for p in b), dp) for b in assign_buckets(ps, bucket_bytes))
        (roots if root else blocks).append(n)
    return sum(roots) + sum(sorted(blocks)[-(3 if gloo else 2):])


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
    dp = shard_dp(cfg, layout)
    return [rank_memory(cfg, chunks, schedule, r, dp, m, layout.dp_per_node) for r, chunks in enumerate(stages)]


def shard_dp(cfg: Config, layout: Layout) -> int:
    """The ranks ZeRO shards over: every rank that averages the gradients — DP's, and CP's with them (the cp·dp
    group) —, or under `parallel.zero_group` (HSDP) a shard group's (`sync.zero.shard_lists`)."""
    if not cfg.parallel.zero:
        return layout.dp
    size = layout.zero_shard_size(str(cfg.parallel.zero_group))
    return size * layout.cp if size == layout.dp else size


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
        return [rank_memory(cfg, c, schedule, r, shard_dp(cfg, layout), m, layout.dp_per_node).total
                for r, c in enumerate(stages)]

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
