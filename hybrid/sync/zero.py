"""ZeRO's groups (`parallel.zero>=1`) and the compressed collectives that run over them (ZeRO++).

- **shard**: the group ZeRO shards parameters, gradients and moments over — the gradients' group, or under
  `parallel.zero_group` (HSDP) consecutive parts of each DP group;
- **replicas** (HSDP): the ranks at the same place of each part; GradSync all-reduces the shards across them once
  a step;
- **node** and **across**: the shard group's two hops when it spans nodes with more than one of its ranks on each —
  its ranks on this node, and the ranks at this rank's place on each of its nodes. hpZ (`parallel.zero_hpz`)
  keeps a secondary copy of the gathered parameters over *node*; qgZ (`compression=int8|int4` under ZeRO) reduces
  exactly inside the node and sends only the codec's payload *across*
  (`compression.zero.TwoHop`).

The shard group and the node hop are counted as `dp_intra`, the replicas and the across hop as `dp_inter` (by role:
HSDP's shard group is a node by default), each with its ranks per node, so `CommCounter.cross_node_bytes` is what
leaves the node wherever a group lies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from hybrid.compression.codecs import CODECS, PARAM_CODECS
from hybrid.compression.zero import REDUCE_SCATTER_CODECS, OneHop, TwoHop
from hybrid.parallel.collectives import Group
from hybrid.parallel.context import groups_of

if TYPE_CHECKING:
    from hybrid.config import Config
    from hybrid.parallel.context import Layout, ParallelContext
    from hybrid.parallel.dp.sharded import EncodedReduceScatter


@dataclass
class ZeroGroups:
    """This rank's ZeRO groups (see the module doc); None where there is no such group."""

    shard: Group = None
    replicas: Group = None
    node: Group = None
    across: Group = None


def shard_lists(cfg: Config, layout: Layout) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) as rank lists: the gradients' groups and none, or HSDP's parts."""
    size = layout.zero_shard_size(str(cfg.parallel.zero_group))
    if size == layout.dp:
        return (layout.groups("cp-dp") if layout.cp > 1 else layout.dp_groups()), []
    return layout.zero_groups(size)


def spans_nodes(layout: Layout, shards: list[list[int]]) -> bool:
    """Whether a shard group has ranks on several nodes and several on each: two hops to tell apart."""
    return 1 < layout.per_node(shards[0]) < len(shards[0])


def needs_hops(cfg: Config, layout: Layout) -> bool:
    """Whether the run uses the node/across hops: hpZ, or a codec's reduce-scatter (qgZ), over a shard group
    that spans nodes."""
    wanted = cfg.parallel.zero_hpz or cfg.compression.method in REDUCE_SCATTER_CODECS
    return cfg.parallel.zero >= 1 and wanted and spans_nodes(layout, shard_lists(cfg, layout)[0])


def zero_groups(cfg: Config, ctx: ParallelContext) -> ZeroGroups:
    """This rank's ZeRO groups. Collective: every rank creates every group (the same calls on each)."""
    if cfg.parallel.zero == 0:
        return ZeroGroups(ctx.grad_group)
    layout = ctx.layout
    shards, replicas = shard_lists(cfg, layout)
    out = ZeroGroups(ctx.grad_group)
    if replicas:
        out.shard, out.replicas = groups_of(ctx, shards, "dp_intra"), groups_of(ctx, replicas, "dp_inter")
    if needs_hops(cfg, layout):
        node, across = layout.node_split(shards)
        out.node, out.across = groups_of(ctx, node, "dp_intra"), groups_of(ctx, across, "dp_inter")
    return out


def param_codec(cfg: Config) -> Any:
    """ZeRO-3's parameter all-gather codec (`parallel.zero_param_codec`, qwZ): None, or int8 or fp8 with
    `compression.block_size`'s blocks."""
    name = cfg.parallel.zero_param_codec
    return None if name == "none" else PARAM_CODECS[name](cfg.compression.block_size)


def hpz_group(cfg: Config, groups: ZeroGroups) -> Group:
    """hpZ's secondary group (`parallel.zero_hpz`): the shard group's ranks on this node, or None."""
    return groups.node if cfg.parallel.zero_hpz else None


def encoded_reduce_scatter(cfg: Config, groups: ZeroGroups) -> Optional[EncodedReduceScatter]:
    """ZeRO's reduce-scatter through `compression=`'s codec (int8, int4): in two hops over a shard group that
    spans nodes (qgZ: exact inside the node, encoded across, with error feedback under
    `parallel.zero_grad_feedback`), else one encoded all-to-all; None for a plain one (in a dtype)."""
    c = cfg.compression
    if c.method not in REDUCE_SCATTER_CODECS:
        return None
    codec = CODECS[c.method].build(c)
    if groups.across is not None:
        return TwoHop(codec, groups.node, groups.across, cfg.parallel.zero_grad_feedback)
    return OneHop(codec)
