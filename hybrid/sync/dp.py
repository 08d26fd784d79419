"""`sync.mode=dp`: synchronous data parallelism, every step's gradients averaged over the DP group.

The gradient sync is `parallel.dp.data.GradSync` over the DP group through the compression hook
(`compression=`): an all-reduce per bucket launched inside the backward, or under `parallel.zero=1` a
reduce-scatter (in a 16-bit dtype, or int8/int4-encoded) that the distributed optimizer's all-gather completes
(under `parallel.zero=2` and 3 one per microbatch, into kept gradient shards; under `parallel.zero_group` inside
groups of DP ranks, the shards all-reduced across them).
The optimizer is AdamW or SGD over the parameters (over fp32 main weights under bf16 parameters), the
distributed optimizer under ZeRO-1, 2 and 3, or 1-bit or 0/1 Adam's under `compression=onebit_adam` or
`zeroone_adam` (its hook state is the momentum exchange; 0/1 Adam's schedule is sized from `train.steps`, handed in
here). The auto compression schedule watches every step's loss (`Compression.observe`); its
decisions are run state. Nothing runs after the optimizer's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.compression.hooks import OPTIMIZER_SIDE, Compression, make_hook
from hybrid.compression.schedule import exact_kinds, exact_param_ids
from hybrid.compression.zero import REDUCE_SCATTER_DTYPES
from hybrid.compression.zeroone_adam import local_steps
from hybrid.config import Config, ConfigError
from hybrid.optim import build_optimizer
from hybrid.parallel.dp.data import CommHook, GradSync, SyncReport
from hybrid.parallel.dp.units import unit_params
from hybrid.sync import exchange
from hybrid.sync.footprint import Footprint
from hybrid.sync.plan import DPPlan, register_sync_mode
from hybrid.sync.zero import encoded_reduce_scatter, hpz_group, param_codec, zero_groups

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout, ParallelContext


def dp_hook(cfg: Config, ctx: ParallelContext, hook: Optional[tuple[CommHook, Any]],
            steps: Optional[int] = None) -> tuple[CommHook, Any]:
    """The DP compression hook and its state: `hook` when the caller brings one, else `compression=`'s, its null
    warm-up sized from a run of `steps` exchanges (None: no warm-up, e.g. DiLoCo's outer exchanges)."""
    return hook or make_hook(cfg.compression, ctx.grad_group, ctx.dp_intra_group, ctx.dp_inter_group, steps)


def kept_exact(cfg: Config, model: nn.ModuleList) -> frozenset[int]:
    """The ids of the parameters the hook keeps exact (`compression.exact_params`), matched on each chunk's own
    names (the model's, global layer indices: `layers.3.mlp.up.weight` on any stage)."""
    c = cfg.compression
    named = ((name, p) for chunk in model for name, p in chunk.named_parameters())
    return exact_param_ids(named, exact_kinds(c.exact_params, c.schedule))


def lookup_tables(cfg: Config, model: nn.ModuleList) -> frozenset[int]:
    """The ids of the parameters read only by a lookup, whose gradient has a row per id a step saw
    (`compression/rows.py`): the token embedding, unless tied to the head (whose gradient is dense). (A learned
    position table is not one: every step touches the same first rows, at full length all of them.)"""
    if cfg.model.tie_embeddings:
        return frozenset()
    return frozenset(id(chunk.tok_embed.weight) for chunk in model if hasattr(chunk, "tok_embed"))


class SynchronousDP:
    """Every step's gradients averaged over DP through the compression hook (see the module doc)."""

    name = "dp"

    def check(self, cfg: Config, layout: Layout) -> None:
        s = cfg.sync
        if not (s.inner_steps == 1 and s.fragments == 1 and s.scope == "dp"):
            raise ConfigError("sync.inner_steps, sync.fragments and sync.scope apply to sync=diloco or "
                              "sync=local_sgd, not to synchronous DP (sync.mode=dp)")

    def build(self, cfg: Config, ctx: ParallelContext, model: nn.ModuleList,
              main: Optional[dict[nn.Parameter, torch.Tensor]], hook: Optional[tuple[CommHook, Any]]) -> DPPlan:
        c = cfg.compression
        run, state = dp_hook(cfg, ctx, hook, cfg.train.steps)
        apart = kept_exact(cfg, model)
        watcher = state if isinstance(state, Compression) else None
        if watcher is not None:
            watcher.exact_params = apart
            watcher.set_lookups(lookup_tables(cfg, model))
        zg = zero_groups(cfg, ctx)  # HSDP: the replicas' all-reduce is the between-node part; qgZ's hops
        report = SyncReport(error=c.measure_error, exact=c.method == "none",
                            inter_node=c.method == "hierarchical" or zg.replicas is not None or zg.across is not None)
        grad_sync = GradSync(list(model.parameters()), zg.shard, run, state, cfg.parallel.bucket_mb, report,
                             apart=apart, main_grads=main is not None, zero=cfg.parallel.zero,
                             units=unit_params(model) if cfg.parallel.zero >= 1 else None, replicas=zg.replicas,
                             encoded_reduce_scatter=encoded_reduce_scatter(cfg, zg),
                             reduce_dtype=REDUCE_SCATTER_DTYPES.get(c.method, torch.float32))
        onebit = state if c.method in OPTIMIZER_SIDE else None  # 1-bit, 0/1 Adam's optimizer drives its exchange
        optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, ctx, grad_sync, main,
                                    cfg.parallel.overlap_param_gather, onebit=onebit, param_codec=param_codec(cfg),
                                    hpz=hpz_group(cfg, zg), steps=cfg.train.steps)  # 0/1 Adam's schedule: sized
        replicas = None if local_steps(c) else ctx.dp_group  # 0/1 Adam's local steps: apart until the next sync
        return DPPlan(grad_sync, optimizer, watcher=watcher, replicas_group=replicas)

    def footprint(self, cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                  device: str, host: bool) -> Footprint:
        """The DP exchange's copies in flight and its codec's state (`exchange.exchange_bytes`)."""
        node = share if 1 < share < dp else 0  # a shard group across nodes: qgZ's two hops
        copies, state = exchange.exchange_bytes(cfg, sizes, dp, device, node)
        return Footprint(state=state, transient=copies)

    def startup(self, cfg: Config, layout: Layout) -> list[str]:
        return exchange.startup_lines(cfg, layout, cfg.train.steps, gradients=True)


SYNCHRONOUS_DP = register_sync_mode(SynchronousDP())
