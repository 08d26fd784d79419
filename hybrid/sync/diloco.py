"""`sync.mode=diloco` (`sync=diloco`, `sync=local_sgd`): H local steps per replica, then an outer step on the
averaged pseudo-gradient (`outer.OuterSync`: anchors, Nesterov momentum, streaming fragments, overlapped
exchanges).

Each replica steps on its own gradients (exact over the node's DP ranks under `sync.scope=inter`, else
alone); after every `sync.inner_steps`-th optimizer step a fragment's pseudo-gradient goes through the
compression hook over DP — between nodes under `sync.scope=inter` — and the outer optimizer steps the inner
optimizer's fp32 weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hybrid.compression.hooks import SERIAL, make_hook
from hybrid.config import Config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import more_groups
from hybrid.parallel.dp.data import CommHook
from hybrid.sync import exchange, outer_policy
from hybrid.sync.dp import dp_hook, kept_exact
from hybrid.sync.exchange import require
from hybrid.sync.footprint import F32, Footprint
from hybrid.sync.outer import OuterSync, largest_share
from hybrid.sync.outer_policy import OuterPolicy
from hybrid.sync.plan import DPPlan, register_sync_mode
from hybrid.sync.replica import check_replica_mode, inner_group, inner_optimizer, inner_sync, trained

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout, ParallelContext


def outer_group(cfg: Config, ctx: ParallelContext) -> Any:
    """The group an outer step averages over: DP, or the DP ranks of the other nodes (scope=inter)."""
    return ctx.dp_inter_group if cfg.sync.scope == "inter" else ctx.dp_group


class DiLoCo:
    """Local steps, then outer steps on averaged pseudo-gradients (see the module doc)."""

    name = "diloco"

    def check(self, cfg: Config, layout: Layout) -> None:
        s = cfg.sync
        check_replica_mode(cfg)
        outer_policy.check(s)
        h = outer_policy.inner_steps(s, cfg.train.steps)
        require(0 <= s.overlap_steps < h, f"sync.overlap_steps must be in [0, sync.inner_steps={h}): an exchange "
                 f"lands before its fragment's next one; got {s.overlap_steps}")
        require(0 <= s.overlap_mix < 1 and (s.overlap_mix == 0 or s.overlap_steps > 0), f"sync.overlap_mix must "
                 f"be in [0, 1), and 0 unless sync.overlap_steps > 0; got {s.overlap_mix}")
        require(not (s.overlap_steps and cfg.compression.method in SERIAL), f"sync.overlap_steps cannot run with "
                 f"compression={cfg.compression.method}: its hook starts collectives from callbacks, which must not "
                 "run across steps (use compression=powersgd)")
        if s.scope == "inter":
            require(layout.num_nodes > 1, f"sync.scope=inter needs DP replicas on more than one node; this layout "
                     f"has {layout.num_nodes} node (set parallel.ranks_per_node to emulate nodes)")
            sizes = {len(g) for g in layout.dp_inter_node_groups()}
            require(sizes != {1}, "sync.scope=inter needs DP ranks on more than one node: every DP group here "
                     "lies inside one node")

    def build(self, cfg: Config, ctx: ParallelContext, model: nn.ModuleList,
              main: Optional[dict[nn.Parameter, torch.Tensor]], hook: Optional[tuple[CommHook, Any]]) -> DPPlan:
        grad_sync = inner_sync(cfg, ctx, model, main)
        optimizer = inner_optimizer(cfg, ctx, model, grad_sync, main)
        apart = kept_exact(cfg, model)
        outer = self.outer(cfg, ctx, model, optimizer, hook, apart)
        return DPPlan(grad_sync, optimizer, replica=outer, watcher=outer.policy if outer.policy.auto else None,
                      replicas_group=inner_group(cfg, ctx), same_norm=False, in_flight=cfg.sync.overlap_steps > 0)

    def outer(self, cfg: Config, ctx: ParallelContext, model: nn.Module, optimizer: Any,
              hook: Optional[tuple[CommHook, Any]], apart: frozenset[int]) -> OuterSync:
        """The outer loop: the compression hook over DP or, when it averages over another group (its own groups
        for an exchange in flight across steps; between nodes under scope=inter), one made for that group."""
        group = outer_group(cfg, ctx)
        if cfg.sync.overlap_steps:  # its own groups: an exchange in flight across steps beside the step's ones
            group = more_groups(ctx, "dp_inter" if cfg.sync.scope == "inter" else "dp", C.group_name(group))
        run, state = dp_hook(cfg, ctx, hook) if group is ctx.dp_group else make_hook(cfg.compression, group)
        state.exact_params = apart
        share = ctx.dp_intra_group if cfg.sync.scope == "inter" else None
        return OuterSync(cfg.sync, OuterPolicy.of(cfg.sync, cfg.train.steps), trained(model), group, run, state,
                         optimizer, cfg.parallel.bucket_mb, apart, share, ctx.embedding_group,
                         (ctx.tp_group, ctx.pp_group))

    def footprint(self, cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                  device: str, host: bool) -> Footprint:
        """The anchors and momentum; the share's pseudo-gradient while an outer step runs (held across steps when
        overlapped) and, with r > 1 DP ranks in the node, the node's combined vector; the outer hook's state."""
        s, elements = cfg.sync, [p.numel() for p in params]
        numel, r = sum(elements), share if s.scope == "inter" else 1
        mine = largest_share(elements, r)  # the outer exchange's elements on the rank with the most
        outer = (1 + OuterPolicy.of(s, cfg.train.steps).buffers) * F32 * numel
        in_flight = F32 * mine if s.overlap_steps else 0  # overlapped: held across steps (at most all of it)
        landing = (0 if s.overlap_steps else mine) + (numel if r > 1 else 0)  # the share itself: in flight
        return Footprint(outer, False, in_flight, F32 * landing, (mine, dp // r))

    def startup(self, cfg: Config, layout: Layout) -> list[str]:
        """What the outer loop will do (H, the outer step and when it changes), then the exchange's codec."""
        return [outer_policy.describe(cfg.sync, cfg.train.steps), *exchange.startup_lines(cfg, layout)]


DILOCO = register_sync_mode(DiLoCo())
