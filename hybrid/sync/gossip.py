"""Decentralized (gossip) SGD: each DP replica steps on its own gradient, then averages its parameters with its
neighbours on a graph — point-to-point only, no global collective.

Every `sync.inner_steps` steps (1: every step), replica i sends its flat fp32 parameters to each neighbour and
receives theirs (one `batch_isend_irecv` over the DP group), then takes θ_i ← (θ_i + Σ_j θ_j) / (deg + 1): a
uniform mixing matrix, doubly stochastic because every graph here is regular (`sync.topology`):

- `ring`: the ranks i ± 1 (mod n);
- `exponential`: i ± 2^k for k < ⌈log₂ n⌉ (the static exponential graph, O(log n) neighbours);
- `one_peer`: one peer per round, i XOR 2^(round mod log₂ n) (the one-peer exponential graph: n a power of two;
  log₂ n rounds average exactly);
- `complete`: every other rank (plain averaging, at n − 1 times a ring's bytes).

The consensus distance, √(mean_i ‖θ_i − θ̄‖²) over the whole model (TP shards and stages summed, replicated
copies counted once), goes into logged records (an uncounted `meter` all-reduce over DP, then sums over TP and
PP), with the bytes sent to replicas on other nodes (`bytes_inter_per_step`). At the run's last step the
replicas are averaged exactly (one all-reduce over DP), so the run ends with one model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.config import Config, SyncConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.collectives import Group
from hybrid.parallel.params import param_info
from hybrid.sync.exchange import require
from hybrid.sync.footprint import F32, Footprint
from hybrid.sync.plan import DPPlan, register_sync_mode
from hybrid.sync.replica import (
    Weights,
    check_replica_mode,
    flat_weights,
    inner_group,
    inner_optimizer,
    inner_sync,
    load_replica_state,
    node_of,
    over_ranks,
    replica_state,
    set_flat_weights,
    single_replica_note,
    trained,
)

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout, ParallelContext

TOPOLOGIES = ("ring", "exponential", "one_peer", "complete")


def neighbours(topology: str, n: int, i: int, round_: int = 0) -> list[int]:
    """Rank `i`'s neighbours (ranks in the group of `n`) in gossip round `round_`, sorted, without `i`."""
    if topology == "ring":
        found = {(i - 1) % n, (i + 1) % n}
    elif topology == "exponential":
        found = {(i + s * 2**k) % n for k in range(max(1, math.ceil(math.log2(n)))) for s in (1, -1)}
    elif topology == "one_peer":
        found = {i ^ 2 ** (round_ % int(math.log2(n)))} if n > 1 else set()
    else:
        found = set(range(n))
    return sorted(found - {i})


def fits(topology: str, n: int) -> bool:
    """Whether `topology` is defined on `n` replicas (one_peer pairs ranks by XOR: a power of two)."""
    return topology != "one_peer" or (n & (n - 1) == 0)


class Gossip:
    """One rank's gossip: its rounds, bytes, and the consensus distance of logged steps."""

    def __init__(self, cfg: SyncConfig, params: list[nn.Parameter], group: Group, weights: Weights,
                 tp_group: Group, pp_group: Group, node_of: Callable[[int], int] = lambda r: 0) -> None:
        self.cfg, self.params, self.group, self.weights = cfg, params, group, weights
        self.tp_group, self.pp_group, self.node_of = tp_group, pp_group, node_of  # node_of: a DP rank's node
        self.events, self.bytes, self.inter_bytes, self.last_step = 0, 0, 0, 0
        self.state = None  # no compression hook state

    def restart(self, step: int = 0) -> None:
        """Nothing to restart: gossip keeps no state beyond the replicas' own."""

    def after_step(self, step: int, last: bool = False) -> list[int]:
        """A gossip round after every `sync.inner_steps`-th step, the exact average after the last; [0] when
        either ran. Collective over the DP group then (point-to-point for a round)."""
        if C.size(self.group) == 1 or not (last or step % self.cfg.inner_steps == 0):
            return []
        before = C.COUNTER.group_bytes(C.group_name(self.group))
        flat = flat_weights(self.weights, self.params)
        mixed = self._average(flat) if last else self._round(flat, self.events)
        set_flat_weights(self.weights, self.params, mixed)
        self.weights.loaded()
        self.bytes += C.COUNTER.group_bytes(C.group_name(self.group)) - before
        self.events, self.last_step = self.events + 1, step
        return [0]

    def _round(self, flat: torch.Tensor, round_: int) -> torch.Tensor:
        me = C.rank(self.group)
        peers = neighbours(self.cfg.topology, C.size(self.group), me, round_)
        self.inter_bytes += sum(self.node_of(p) != self.node_of(me) for p in peers) * flat.numel() * 4
        theirs = [torch.empty_like(flat) for _ in peers]
        C.exchange([(flat, p) for p in peers], list(zip(theirs, peers)), self.group)
        return torch.stack([flat, *theirs]).sum(0).div_(len(peers) + 1)

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        me, n = C.rank(self.group), C.size(self.group)
        if any(self.node_of(r) != self.node_of(me) for r in range(n)):  # its payload crosses nodes once
            self.inter_bytes += flat.numel() * 4
        C.all_reduce(flat, self.group)
        return flat.div_(C.size(self.group))

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """√(mean over replicas of ‖θ_i − θ̄‖²), the whole model's. Collective: a `meter` all-reduce of the
        parameters and of a scalar over DP, then scalar all-reduces over TP and PP."""
        if C.size(self.group) == 1:
            return 0.0
        flat = flat_weights(self.weights, self.params)
        mean = flat.clone()
        with C.TIMER.collective(C.group_name(self.group), "meter"):
            dist.all_reduce(mean, group=self.group)
        C.COUNTER.record("meter", "all_reduce", mean, C.size(self.group))
        mean.div_(C.size(self.group))
        sq, offset = torch.zeros((), dtype=torch.float64, device=flat.device), 0
        for p in self.params:
            part = slice(offset, offset + p.numel())
            offset += p.numel()
            info = param_info(p)
            if not (info.pp_duplicate or (info.tp_duplicate and C.rank(self.tp_group) != 0)):
                sq += (flat[part] - mean[part]).double().square().sum()
        for group in (self.group, self.tp_group, self.pp_group):
            if C.size(group) > 1:
                dist.all_reduce(sq, group=group)
        return math.sqrt(float(sq) / C.size(self.group))

    def record(self, steps: int) -> dict[str, float]:
        """The metrics record's sync keys, bytes as the mean over ranks (collective: that mean's and the
        consensus distance's all-reduces)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        sent, inter = over_ranks([self.bytes / max(steps, 1), self.inter_bytes / max(steps, 1)], device)
        return {"sync_events": self.events, "sync_last_step": self.last_step, "bytes_outer_per_step": sent,
                "bytes_inter_per_step": inter, "consensus_distance": self.consensus_distance()}

    def state_dict(self) -> dict[str, Any]:
        return {**replica_state(self.weights, self.params), "events": self.events, "bytes": self.bytes,
                "inter_bytes": self.inter_bytes, "last_step": self.last_step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        load_replica_state(self.weights, self.params, sd)
        self.events, self.bytes, self.last_step = int(sd["events"]), int(sd["bytes"]), int(sd["last_step"])
        self.inter_bytes = int(sd["inter_bytes"])
        self.weights.loaded()


class GossipMode:
    """`sync.mode=gossip`: each replica steps on its own gradients, then mixes parameters with its neighbours."""

    name = "gossip"

    def check(self, cfg: Config, layout: Layout) -> None:
        s = cfg.sync
        check_replica_mode(cfg)
        require(s.topology in TOPOLOGIES, f"sync.topology={s.topology!r} is not one of {', '.join(TOPOLOGIES)}")
        require(fits(s.topology, layout.dp), f"sync.topology={s.topology} pairs replicas by XOR and needs a DP "
                 f"size that is a power of two, got dp={layout.dp}")
        require(s.scope == "dp" and s.fragments == 1, "sync=gossip exchanges whole replicas over DP: sync.scope=dp "
                 "and sync.fragments=1")
        require(cfg.compression.method == "none", f"sync=gossip exchanges fp32 parameters; compression="
                 f"{cfg.compression.method} applies to gradients (sync=dp) and outer steps (sync=diloco)")

    def build(self, cfg: Config, ctx: ParallelContext, model: nn.ModuleList, main: Optional[dict],
              hook: Any) -> DPPlan:
        grad_sync = inner_sync(cfg, ctx, model, main)
        optimizer = inner_optimizer(cfg, ctx, model, grad_sync, main)
        gossip = Gossip(cfg.sync, trained(model), ctx.dp_group, optimizer, ctx.tp_group, ctx.pp_group, node_of(ctx))
        return DPPlan(grad_sync, optimizer, replica=gossip, replicas_group=inner_group(cfg, ctx), same_norm=False)

    def footprint(self, cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                  device: str, host: bool) -> Footprint:
        """While a round runs: the flat parameters, each neighbour's, their stack and the mean."""
        peers = max(len(neighbours(cfg.sync.topology, dp, i)) for i in range(dp))
        numel = sum(p.numel() for p in params)
        return Footprint(transient=(2 * peers + 3) * F32 * numel if dp > 1 else 0)

    def startup(self, cfg: Config, layout: Layout) -> list[str]:
        return single_replica_note(cfg, layout.dp)


GOSSIP = register_sync_mode(GossipMode())
