"""DP gradient sync: flat fp32 gradient buckets whose comm hook starts during the backward.

Every parameter's `.grad` is a view into its bucket's flat buffer (as DDP's
`gradient_as_bucket_view`), so autograd accumulates straight into the buffer over the
microbatches. A post-accumulate-grad hook counts accumulations: once every parameter of a
bucket has received one per microbatch, its gradients are final for this step, and the
bucket's comm hook is launched right there, inside the backward, while autograd keeps
computing earlier layers. The trigger counts gradients, not schedule phases, so it works
under any pipeline schedule. Buckets launch in index order (bucket 0 holds the last
parameters, whose gradients finish first), so `is_last()` is the last launched.

The hook is PyTorch DDP's comm-hook protocol: `hook(state, bucket) -> Future[Tensor]`, the
future's value being the bucket's reduced (mean) gradient. This module knows compression only
through that protocol, plus the optional `MeteredState` interface (`measure`, `take_error()`)
through which GradSync meters the compression error on logged steps and reports its own
figures (`bytes_dp`, `compression_ratio`, `compression_error`).

Main gradients (`main_grads=True`, under `train.precision=bf16_params`): the parameters are bf16, so their
`.grad` cannot be a view of an fp32 buffer. As Megatron's `main_grad`, each parameter's `main_grad` is then
the buffer view; the post-accumulate hook adds the bf16 `.grad` autograd produced into it and drops `.grad`,
so the microbatches accumulate in fp32. `grads.grad_of(p)` is the gradient everything after the backward reads.

Sharded (`zero=1`, the distributed optimizer's): each bucket is padded to dp equal shards and
reduce-scattered instead, from the same trigger; DP rank r keeps the mean of shard r, and the optimizer
(`hybrid.optim.distributed`) updates that shard and all-gathers the parameters. Under `zero=2` (and 3) no bucket
keeps a buffer: each microbatch's gradients are reduce-scattered into kept fp32 shards (`sharded.ShardedGrads`);
under any ZeRO stage the buckets are cut inside `units` (a block's parameters, a chunk's root: `units.py`).

`finalize_grads` is the one place where a step's gradients become final: the DP buckets, then
the model-parallel sums of `grads.py` (tied embedding, sequence-parallel replicated parameters).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.dp.buckets import GradBucket, assign_buckets, assign_units, padded_numel
from hybrid.parallel.dp.grads import sync_sequence_parallel_grads, sync_tied_grads
from hybrid.parallel.dp.sharded import EncodedReduceScatter, ShardedGrads, shard_of

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

DP_GROUPS = ("dp", "dp_intra", "dp_inter", "ps")
"""The counter names whose traffic is gradient sync (`bytes_dp`): the last two of DP's only under hierarchical; the
parameter server's pushes and replies (`sync=ps`)."""


@runtime_checkable
class MeteredState(Protocol):
    """A hook state that can meter its error: with `measure` set, each bucket's hook also runs one
    exact, uncounted all-reduce and accumulates Σ‖ĝ − g‖² and Σ‖g‖², which `take_error()` returns
    and clears. (`hybrid.compression.hooks.Compression` is one.)"""

    measure: bool

    def take_error(self) -> tuple[float, float]: ...


@dataclass(frozen=True)
class SyncReport:
    """Which figures GradSync's metrics records carry (set by whoever knows the compression config)."""

    error: bool = False  # compression_error: ‖ĝ − g‖/‖g‖, metered on the steps `meter(True)` names
    exact: bool = False  # the hook is the exact mean: never metered, its error reads 0
    inter_node: bool = False  # bytes_dp_inter: the between-node part of hierarchical sync


class Launched:
    """A launched collective as GradSync waits for it (gloo's reduce-scatter has no future): `wait()` waits
    for the work (None: it completed when launched), runs `then` (a copy back from a reduce dtype) and returns
    None (nothing to write back)."""

    def __init__(self, work: Any, then: Optional[Callable[[], Any]] = None) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.then is not None:
            self.then()


class GradSync:
    """Owns the gradient buffers of `params` and syncs them over the DP group each step.

    Per step: `begin_step(num_microbatches)`, optionally `meter(on)`, the backward passes (hooks
    launch by themselves), `finish()` (launches any bucket whose parameters got no gradient, waits,
    writes results back; `finalize_grads` calls it), the optimizer step, `zero_grad()`. On a
    logged step, `local_metrics()` and `metrics()` turn the counted DP traffic and the metered
    error into the record's `bytes_dp`, `compression_ratio`, `compression_error` (`report` says
    which of them the record carries).
    """

    def __init__(self, params: list[nn.Parameter], group: Group, hook: CommHook, state: Any,
                 bucket_mb: float = 25.0, report: SyncReport = SyncReport(), in_backward: bool = True,
                 apart: frozenset[int] = frozenset(), zero: int = 0,
                 reduce_dtype: torch.dtype = torch.float32, main_grads: bool = False,
                 encoded_reduce_scatter: Optional[EncodedReduceScatter] = None,
                 units: Optional[list[list[nn.Parameter]]] = None, replicas: Group = None) -> None:
        self.group, self.hook, self.state, self.report = group, hook, state, report
        self.replicas = replicas  # HSDP: `group` shards, the shards are all-reduced over these once a step
        self.scale = C.size(group) * C.size(replicas)  # the ranks a gradient is averaged over
        self.main_grads = main_grads  # fp32 `p.main_grad` views, the low-precision `.grad` folded in by the hook
        self.in_backward = in_backward  # False: every bucket waits for finish() (no overlap; a test switch)
        self.enabled = C.size(group) > 1
        self.zero = zero  # 1: reduce-scatter each bucket once a step; 2, 3: every microbatch, into kept shards
        self.reduce_dtype = reduce_dtype  # the sharded path's reduce-scatter dtype (fp16/bf16: half the bytes)
        self.encoded = encoded_reduce_scatter  # or an encoded one (int8: an all-to-all of about a quarter)
        size = int(bucket_mb * 2**20)  # ZeRO: buckets inside `units` (ZeRO-3 gathers and frees them with a unit)
        groups = (assign_units(units, size, apart) if units is not None else
                  assign_buckets([p for p in params if p.requires_grad], size, apart))
        self.buckets: list[GradBucket] = []
        on_ready = _weak_hook(self)
        self._bucket_of: dict[int, int] = {}
        for i, ps in enumerate(groups):
            numel = sum(p.numel() for p in ps)
            numel = padded_numel(numel, C.size(group)) if self.sharded else numel
            held = None if zero >= 2 else torch.zeros(numel, dtype=torch.float32, device=ps[0].device)
            bucket = GradBucket(i, held, ps, is_last=i == len(groups) - 1, numel=numel)
            for p, view in zip(ps, bucket.gradients()):
                if main_grads:
                    p.main_grad = view
                else:
                    p.grad = view
            for p in ps:
                self._bucket_of[id(p)] = i
                p.register_post_accumulate_grad_hook(on_ready)
            self.buckets.append(bucket)
        self.reduced = (ShardedGrads(self.buckets, group, reduce_dtype, encoded_reduce_scatter, size // 4, self.scale)
                        if zero >= 2 else None)
        if self.reduced is not None:  # what the step reads of a parameter's gradient: its fragment of the shard
            for i, b in enumerate(self.buckets):
                for p in b.parameters():
                    p.main_grad = self.reduced.fragment(p, i)
        self._metered = False  # whether this step meters the compression error (`meter`)
        self.launch_log: list[tuple[int, bool]] = []  # (bucket index, launched by the gradient-ready hook)
        self.last_launch_log: list[tuple[int, bool]] = []  # the previous step's, kept by finish()
        self.begin_step(1)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer updates this rank's shard of each bucket (any ZeRO stage)."""
        return self.zero >= 1

    def begin_step(self, num_microbatches: int) -> None:
        """Expect one accumulation per parameter per microbatch this step."""
        self._expected = num_microbatches
        self._seen = {id(p): 0 for b in self.buckets for p in b.parameters()}
        self._pending = [len(b.parameters()) for b in self.buckets]
        self._futures: list[Optional[torch.futures.Future | Launched]] = [None] * len(self.buckets)
        self._next = 0
        self.launch_log = []

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b = self._bucket_of[id(p)]
        if self.reduced is not None:  # ZeRO-2, 3: into the bucket's round, reduce-scattered once it is whole
            grad, p.grad = p.grad, None
            self.reduced.add(b, p, grad)
            return
        if self.main_grads:
            p.main_grad.add_(p.grad)  # fp32 accumulation of the microbatches' low-precision gradients
            p.grad = None
        elif p.grad is None or not _is_view_of(p.grad, self.buckets[b].buffer()):
            raise RuntimeError("a parameter's .grad was replaced; use GradSync.zero_grad(), not set_to_none")
        self._seen[id(p)] += 1
        if self._seen[id(p)] == self._expected:
            self._pending[b] -= 1
            if self.in_backward:
                self._launch_ready(in_backward=True)

    def _launch_ready(self, in_backward: bool) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next, in_backward)

    def _launch(self, i: int, in_backward: bool) -> None:
        self._pending[i] = 0
        self._next = i + 1
        self.launch_log.append((i, in_backward))  # from the gradient-ready hook: autograd runs it in the backward
        if self.enabled:
            self._futures[i] = self._start(self.buckets[i])

    def _start(self, bucket: GradBucket) -> torch.futures.Future | Launched:
        """The all-reduce path: the comm hook, whose future holds the bucket's DP mean. The sharded path
        (ZeRO-1): one reduce-scatter of the buffer over DP (pre-divided by dp, so the shard holds the mean) —
        or, with a codec, its encoded all-to-all —, its result left in place in this rank's shard; the rest
        of the buffer is not read afterwards."""
        if not self.sharded:
            return self.hook(self.state, bucket)
        buf = bucket.buffer().div_(self.scale)  # before any cast: the sum stays in fp16's range
        if self.encoded is not None:
            self.encoded(buf, self.group, bucket.index())  # blocking (gloo's all-to-all): complete when launched
            return Launched(None)
        low = buf if self.reduce_dtype == buf.dtype else buf.to(self.reduce_dtype)
        work = C.reduce_scatter_flat(self.shard(bucket, low), low, self.group, async_op=True)
        back = (lambda: self.shard(bucket).copy_(self.shard(bucket, low))) if low is not buf else None
        return Launched(work, back)

    def shard(self, bucket: GradBucket, buf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This DP rank's contiguous 1/dp of a sharded bucket's buffer (or of `buf`, laid out alike)."""
        return shard_of(bucket.buffer() if buf is None else buf, self.group)

    def grad_shard(self, i: int) -> torch.Tensor:
        """This DP rank's reduced shard of bucket `i` after `finish`: a range of its buffer (ZeRO-1) or the
        kept shard (ZeRO-2, 3)."""
        return self.reduced.shards[i] if self.reduced is not None else self.shard(self.buckets[i])

    def finish(self) -> None:
        """Launch what has not launched (unused parameters), wait, write the results back. The launches
        and the waits here are time the training thread spends on DP communication: the DP group's
        exposed time under `C.TIMER`."""
        if self.reduced is not None:
            self.reduced.finish()
            self.launch_log, self.last_launch_log = [], list(self.reduced.rounds)
            self._across_replicas()
            return
        with C.TIMER.waiting(C.group_name(self.group)) if self.enabled else contextlib.nullcontext():
            while self._next < len(self.buckets):
                self._launch(self._next, in_backward=False)
            results = [None if fut is None else fut.wait() for fut in self._futures]
        for bucket, result in zip(self.buckets, results):
            if result is not None:
                write_back(bucket, result)
        self._across_replicas()
        self.last_launch_log = self.launch_log
        self.begin_step(self._expected)

    def _across_replicas(self) -> None:
        """HSDP: each reduced shard summed over the replica group (an all-reduce per bucket, once a step: the
        shards were divided by every DP rank, so the sum is the mean)."""
        if self.replicas is not None and self.sharded:
            for i in range(len(self.buckets)):
                C.all_reduce(self.grad_shard(i), self.replicas)

    def zero_grad(self) -> None:
        if self.reduced is not None:
            self.reduced.zero_()
            return
        for b in self.buckets:
            b.buffer().zero_()

    def held_bytes(self) -> int:
        """Bytes of gradient storage held now: the buckets' buffers (none between ZeRO-2's rounds) and shards."""
        shards = self.reduced.shards if self.reduced is not None else []
        return sum(b.buffer().nbytes for b in self.buckets if b.held()) + sum(s.nbytes for s in shards)

    def parameters(self) -> list[nn.Parameter]:
        """Every synced parameter, in bucket order (the order the gradient norm sums them in)."""
        return [p for b in self.buckets for p in b.parameters()]

    # ---- metrics: the record's DP figures --------------------------------------------------

    def meter(self, on: bool) -> None:
        """Whether the coming step meters ‖ĝ − g‖ (one exact, uncounted all-reduce per bucket): on the
        steps whose record carries `compression_error`, never for an exact hook."""
        self._metered = (on and self.report.error and not self.report.exact and not self.sharded
                         and isinstance(self.state, MeteredState))
        if isinstance(self.state, MeteredState):
            self.state.measure = self._metered

    def local_metrics(self) -> list[float]:
        """This rank's figures of the last step, to be summed over the world (by the caller's one
        metrics all-reduce) and handed to `metrics`: bytes over the DP groups, over `dp_inter`, the
        ring-wire bytes they imply, the wire bytes of an exact fp32 ring all-reduce of the buckets,
        Σ‖ĝ − g‖² and Σ‖g‖² (taken from a metered state, which clears them)."""
        count = C.COUNTER
        numel = sum(b.numel() for b in self.buckets)
        n = self.scale  # every DP rank, under HSDP too
        plain_wire = 4 * numel * 2 * (n - 1) / n  # what the exact fp32 ring all-reduce would send
        err_sq, ref_sq = self.state.take_error() if isinstance(self.state, MeteredState) else (0.0, 0.0)
        return [sum(count.group_bytes(g) for g in DP_GROUPS), count.group_bytes("dp_inter"),
                sum(count.wire_bytes(g) for g in DP_GROUPS), plain_wire, err_sq, ref_sq, count.group_bytes("meter")]

    def bucket_figures(self) -> dict[int, dict[str, float]]:
        """The hook state's figures per bucket index, for the error budget (`hybrid.record.error_budget`); none
        from a state without them."""
        figures = getattr(self.state, "bucket_figures", None)
        return figures() if figures is not None and not self.report.exact else {}

    def metrics(self, sums: Sequence[float], world: int) -> dict[str, float]:
        """The record's DP keys from `local_metrics()` summed over the `world` ranks: bytes averaged
        per rank, the compression ratio (exact ring bytes / sent ring bytes; absent where nothing was sent) and the
        relative error."""
        dp, inter, wire, plain_wire, err_sq, ref_sq, meter = sums
        out = {"bytes_dp": dp / world}
        if self.report.inter_node:
            out["bytes_dp_inter"] = inter / world  # the compressed, between-node part
        if C.size(self.group) > 1:
            if wire:  # a step that sends nothing (0/1 Adam's local steps) has no ratio to report
                out["compression_ratio"] = plain_wire / wire
            if self._metered:
                out["compression_error"] = (err_sq / ref_sq) ** 0.5 if ref_sq else 0.0
                out["bytes_meter"] = meter / world  # the meter's exact all-reduce: not training traffic
        return out


def write_back(bucket: GradBucket, result: Any) -> None:
    """Put a comm hook's result (a tensor, or DDP's one-tensor list) into the bucket's buffer."""
    if isinstance(result, list):
        result = result[0]
    if result.data_ptr() != bucket.buffer().data_ptr():
        bucket.buffer().copy_(result)


def finalize_grads(grad_sync: GradSync, embedding_group: Group, tp_group: Group) -> None:
    """Make this step's gradients final, the one place that does: wait for the DP buckets
    (`GradSync.finish`), then sum the tied embedding's two pipeline copies over the embedding group
    (one all-reduce) and, under sequence parallelism, the replicated parameters' partial gradients
    over TP (one coalesced all-reduce). The order is fixed: results are bit-exact against it."""
    grad_sync.finish()
    params = grad_sync.parameters()
    sync_tied_grads(params, embedding_group)
    sync_sequence_parallel_grads(params, tp_group)


def _is_view_of(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start = buf.data_ptr()
    return start <= t.data_ptr() < start + buf.numel() * buf.element_size()


def _weak_hook(sync: GradSync) -> Any:
    """The parameters' grad hook, holding `sync` weakly: a bound method would tie every parameter to
    the GradSync (and back) through autograd's hook table, which Python's GC cannot see, so a dropped
    Trainer's model and gradient buffers would never be freed."""
    ref = weakref.ref(sync)

    def on_ready(p: nn.Parameter) -> None:
        target = ref()
        if target is not None:
            target._on_grad_ready(p)

    return on_ready
