"""How DP replicas agree (`sync.mode`): the modes of the DP dimension, each leaving TP and PP inside a replica
as they are.

- `dp`: synchronous data parallelism: every step's gradients averaged over the DP group through the
  compression hook (`parallel.data.GradSync`).
- `diloco` (`sync=diloco`, `sync=local_sgd`): H local steps per replica, then an outer step on the averaged
  pseudo-gradient (`outer.OuterSync`). Under `sync.scope=inter` the DP ranks of a node still average their
  gradients every step (exactly); only the exchange between nodes waits H steps.
- `gossip` (`sync=gossip`): each replica steps alone, then averages its parameters with its neighbours on a
  graph (`gossip.Gossip`).
- `ps` (`sync=ps`, `sync=ps_async`): workers push gradients to parameter-server shards hosted by the first
  DP ranks and pull parameters, synchronously or with bounded staleness (`ps.PSWorker`, the optimizer seam).

`gradient_sync` builds the per-step gradient sync of a mode, `replica_sync` its replica-level sync (None for
dp), `replicas_group` the group whose ranks hold equal parameters after every step (the health check's), and
`check` validates the `sync` config against the layout (one line, `ConfigError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from hybrid.compression.hooks import SERIAL, make_hook
from hybrid.config import CompressionConfig, Config, ConfigError
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.context import ParallelContext, more_groups
from hybrid.parallel.data import CommHook, GradSync, SyncReport
from hybrid.sync.gossip import TOPOLOGIES, Gossip, fits
from hybrid.sync.outer import OuterSync
from hybrid.sync.ps import PSWorker
from hybrid.sync.replica import Weights

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout

MODES = ("dp", "diloco", "gossip", "ps")
SCOPES = ("dp", "inter")
INCOMPATIBLE = {"compression.method": ("hierarchical", "onebit_adam"), "compression.schedule": ("auto",),
                "parallel.zero": (1,)}
"""Options a replica-level mode refuses: hierarchical compression (use `sync.scope=inter`), 1-bit Adam (an
optimizer-side gradient compression), the auto compression schedule (it watches every step's gradient
exchange), the distributed optimizer (its shards assume replicas that agree)."""

__all__ = ["MODES", "OuterSync", "check", "gradient_sync", "inner_group", "outer_group", "replica_sync",
           "replicas_group"]


def inner_group(cfg: Config, ctx: ParallelContext) -> Group:
    """The group whose gradients are averaged every step: DP (sync=dp), the node's DP ranks (scope=inter),
    or none (a replica alone)."""
    if cfg.sync.mode == "dp":
        return ctx.dp_group
    return ctx.dp_intra_group if cfg.sync.scope == "inter" else None


def outer_group(cfg: Config, ctx: ParallelContext) -> Group:
    """The group an outer step averages over: DP, or the DP ranks of the other nodes (scope=inter)."""
    return ctx.dp_inter_group if cfg.sync.scope == "inter" else ctx.dp_group


def replicas_group(cfg: Config, ctx: ParallelContext) -> Group:
    """The ranks whose parameters are equal after every step (what the divergence check compares over DP)."""
    return inner_group(cfg, ctx)


def gradient_sync(cfg: Config, ctx: ParallelContext, model: nn.Module, hook: CommHook, state: Any,
                  apart: frozenset[int], main_grads: bool, **kwargs: Any) -> GradSync:
    """The per-step gradient sync: over DP through the compression hook (sync=dp; `kwargs`: GradSync's
    sharding options), exactly over a node's DP ranks (scope=inter), or none."""
    params, bucket_mb = list(model.parameters()), cfg.parallel.bucket_mb
    if cfg.sync.mode == "dp":
        c = cfg.compression
        report = SyncReport(error=c.measure_error, exact=c.method == "none", inter_node=c.method == "hierarchical")
        return GradSync(params, ctx.dp_group, hook, state, bucket_mb, report, apart=apart, main_grads=main_grads,
                        **kwargs)
    group = inner_group(cfg, ctx)
    exact, exact_state = make_hook(CompressionConfig(method="none"), group)
    return GradSync(params, group, exact, exact_state, bucket_mb, SyncReport(exact=True), main_grads=main_grads)


def replica_sync(cfg: Config, ctx: ParallelContext, model: nn.Module, weights: Weights, hook: CommHook,
                 state: Any, apart: frozenset[int]) -> Optional[OuterSync | Gossip | PSWorker]:
    """The mode's replica-level sync over `model`'s trained parameters (None under sync=dp). DiLoCo's outer step
    runs `hook` (the compression hook over DP) or, when it averages over another group, one made for it."""
    if cfg.sync.mode == "dp":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.sync.mode == "gossip":
        return Gossip(cfg.sync, params, ctx.dp_group, weights, ctx.tp_group, ctx.pp_group, node_of(ctx))
    if cfg.sync.mode == "ps":  # pushes and replies each on groups of their own over the DP ranks
        push, pull = (more_groups(ctx, "dp", "ps", backend="gloo") for _ in range(2))  # CPU, beside NCCL too
        return PSWorker(cfg, ctx, params, push, pull, node_of(ctx))
    group = outer_group(cfg, ctx)
    if cfg.sync.overlap_steps:  # its own groups: an exchange in flight across steps beside the step's collectives
        group = more_groups(ctx, "dp_inter" if cfg.sync.scope == "inter" else "dp", C.group_name(group))
    if group is not ctx.dp_group:  # the compression hook of the outer group (scope=inter: between nodes)
        hook, state = make_hook(cfg.compression, group)
    state.exact_params = apart
    share = ctx.dp_intra_group if cfg.sync.scope == "inter" else None
    return OuterSync(cfg.sync, params, group, hook, state, weights, cfg.parallel.bucket_mb, apart, share,
                     ctx.embedding_group)


def node_of(ctx: ParallelContext) -> Callable[[int], int]:
    """A DP rank (in this rank's DP group) → its node."""
    def node(dp_rank: int) -> int:
        return ctx.layout.node(ctx.layout.rank(ctx.pp_rank, dp_rank, ctx.tp_rank))
    return node


def check(cfg: Config, layout: Layout) -> None:
    """The `sync` config against the layout and the other options. Raises ConfigError (one line)."""
    s = cfg.sync
    _require(s.mode in MODES, f"sync.mode={s.mode!r} is not one of {', '.join(MODES)}")
    _require(s.scope in SCOPES, f"sync.scope={s.scope!r} is not one of {', '.join(SCOPES)}")
    _require(s.inner_steps >= 1, f"sync.inner_steps must be >= 1, got {s.inner_steps}")
    _require(1 <= s.fragments <= s.inner_steps,
             f"sync.fragments must be between 1 and sync.inner_steps={s.inner_steps}, got {s.fragments}")
    if s.mode == "dp":
        _require(s.inner_steps == 1 and s.fragments == 1 and s.scope == "dp",
                 "sync.inner_steps, sync.fragments and sync.scope apply to sync=diloco or sync=local_sgd, not to "
                 "synchronous DP (sync.mode=dp)")
    _require(s.mode == "ps" or (s.servers == 1 and not s.asynchronous and s.max_staleness == 0 and not
                                s.staleness_weighting), "sync.servers, sync.asynchronous, sync.max_staleness and "
             "sync.staleness_weighting apply to sync=ps (the parameter server)")
    _require(s.mode == "diloco" or (s.overlap_steps == 0 and s.overlap_mix == 0), "sync.overlap_steps and "
             "sync.overlap_mix apply to sync=diloco or sync=local_sgd (the outer exchange)")
    _require(s.max_staleness == 0 or s.asynchronous, f"sync.max_staleness={s.max_staleness} needs "
             "sync.asynchronous=true (a synchronous server has none)")
    if s.mode == "dp":
        return
    for key, bad in INCOMPATIBLE.items():
        value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        _require(value not in bad, f"sync.mode={s.mode} cannot run with {key}={value}"
                 + (" (use sync.scope=inter)" if value == "hierarchical" else ""))
    if s.mode == "gossip":
        _check_gossip(cfg, layout)
    if s.mode == "ps":
        _check_ps(cfg, layout)
        return
    _require(s.outer_lr > 0, f"sync.outer_lr must be > 0, got {s.outer_lr}")
    _require(0 <= s.outer_momentum < 1, f"sync.outer_momentum must be in [0, 1), got {s.outer_momentum}")
    _require(0 <= s.overlap_steps < s.inner_steps, f"sync.overlap_steps must be in [0, sync.inner_steps="
             f"{s.inner_steps}): an exchange lands before its fragment's next one; got {s.overlap_steps}")
    _require(0 <= s.overlap_mix < 1 and (s.overlap_mix == 0 or s.overlap_steps > 0), f"sync.overlap_mix must be "
             f"in [0, 1), and 0 unless sync.overlap_steps > 0; got {s.overlap_mix}")
    _require(not (s.overlap_steps and cfg.compression.method in SERIAL), f"sync.overlap_steps cannot run with "
             f"compression={cfg.compression.method}: its hook starts collectives from callbacks, which must not "
             "run across steps (use compression=powersgd)")
    if s.scope == "inter":
        _require(layout.num_nodes > 1, f"sync.scope=inter needs DP replicas on more than one node; this layout "
                 f"has {layout.num_nodes} node (set parallel.ranks_per_node to emulate nodes)")
        sizes = {len(g) for g in layout.dp_inter_node_groups()}
        _require(sizes != {1}, "sync.scope=inter needs DP ranks on more than one node: every DP group here "
                 "lies inside one node")


def _check_gossip(cfg: Config, layout: Layout) -> None:
    s = cfg.sync
    _require(s.topology in TOPOLOGIES, f"sync.topology={s.topology!r} is not one of {', '.join(TOPOLOGIES)}")
    _require(fits(s.topology, layout.dp), f"sync.topology={s.topology} pairs replicas by XOR and needs a DP size "
             f"that is a power of two, got dp={layout.dp}")
    _require(s.scope == "dp" and s.fragments == 1, "sync=gossip exchanges whole replicas over DP: sync.scope=dp "
             "and sync.fragments=1")
    _require(cfg.compression.method == "none", f"sync=gossip exchanges fp32 parameters; compression="
             f"{cfg.compression.method} applies to gradients (sync=dp) and outer steps (sync=diloco)")


def _check_ps(cfg: Config, layout: Layout) -> None:
    s, t = cfg.sync, cfg.train
    _require(s.servers >= 1, f"sync.servers must be >= 1, got {s.servers}")
    _require(s.servers <= layout.dp, f"sync.servers={s.servers} is more than the DP ranks that host them "
             f"(dp={layout.dp}): each server shard lives on one DP rank of each (pp, tp) coordinate")
    _require(s.max_staleness >= 0, f"sync.max_staleness must be >= 0, got {s.max_staleness}")
    _require(s.scope == "dp" and s.fragments == 1 and s.inner_steps == 1, "sync=ps exchanges every step over DP: "
             "sync.scope=dp, sync.fragments=1, sync.inner_steps=1")
    _require(cfg.compression.method == "none", f"sync=ps pushes fp32 gradients; compression="
             f"{cfg.compression.method} applies to sync=dp and sync=diloco")
    _require(t.precision != "bf16_params", "sync=ps keeps fp32 parameters on the servers: use train.precision="
             "bf16 (autocast) or fp32")
    _require(t.on_nonfinite == "stop", f"sync=ps stops on a non-finite gradient (the servers have applied the "
             f"step's others): train.on_nonfinite={t.on_nonfinite} is not available with it")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)
