"""A parameter server over torch.distributed point-to-point: workers push gradients and pull parameters; the
servers hold shards of the parameters and the optimizer, and apply versions with bounded staleness.

Layout: each (pp, tp) coordinate's trained parameters, flattened in the model's order, fall into
`sync.servers` = S contiguous shards; shard s is served by a thread on that coordinate's DP rank s (S ≤ dp),
so TP and PP inside a replica stay as they are and every exchange stays inside one DP group. Pushes travel on
one gloo process group over the DP ranks, replies on another (CPU tensors: on a CUDA run the gradients and
parameters are staged through the host; the host's own worker uses in-process queues).

A worker's step (`PSWorker.step`, the optimizer seam): the gradient's global norm over TP and PP, clipping by
it (each worker its own), then to every server one push — [clock c, the version its parameters are, lr, the
version it needs back] and the shard's gradient — and from every server one reply — [version] and the shard's
parameters.

A server keeps the pushes per clock; once all dp workers' gradients of clock v are in, it takes one step of
`optim.name`'s optimizer (fused AdamW by default, on its shard's slices: the same element-wise update as the
whole parameters') on their mean, in DP-rank order (each weighted 1/(1+staleness) under
`sync.staleness_weighting`), and the version becomes v+1. It answers a push of clock c once its version
reaches the one the push needs, c + 1 − k (k = `sync.max_staleness`, 0 unless `sync.asynchronous`), with the
parameters of exactly that version (it keeps the last k + 1): every shard, TP rank and stage of a replica
computes on one model, and a run repeats bit for bit whatever the timing. With k = 0 every worker waits for
every clock (synchronous DP; each worker clips its own gradient, so exactly so without clipping); with k > 0
a worker computes clock c on version c − k (a fixed delay, each push's staleness recorded) and so runs up to
k steps ahead of the slowest before it waits.

At the run's last step every worker waits for the final version, so the run ends with one model; then it
tells the servers to stop. A checkpoint first waits until this rank's server has applied every clock before
it (nothing in flight), then saves the server's shard, optimizer state and version with the worker's own
parameters (the sync blob).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.config import Config, optimizer_moments
from hybrid.optim.adamw import clip_grads, finite, global_grad_norm
from hybrid.parallel import collectives as C
from hybrid.parallel.context import ParallelContext, more_groups
from hybrid.parallel.dp.grads import grad_of
from hybrid.sync.exchange import require
from hybrid.sync.footprint import F32, Footprint
from hybrid.sync.plan import DPPlan, register_sync_mode
from hybrid.sync.replica import (
    check_replica_mode,
    inner_group,
    inner_sync,
    node_of,
    over_ranks,
    single_replica_note,
    trained,
)
from hybrid.sync.server import STOP, Server, shard_bounds

if TYPE_CHECKING:
    from hybrid.parallel.context import Layout


class PSWorker:
    """A worker's side, behind the optimizer seam (`step(lr)`), and the host of its coordinate's server shard
    when its DP rank is below `sync.servers`."""

    moments: tuple[str, ...] = ()  # the optimizer's state lives on the servers

    def __init__(self, cfg: Config, ctx: ParallelContext, params: list[nn.Parameter], push: dist.ProcessGroup,
                 pull: dist.ProcessGroup, node_of: Callable[[int], int] = lambda r: 0) -> None:
        self.cfg, self.ctx, self.params, self.push, self.pull = cfg, ctx, params, push, pull
        self.node_of = node_of  # a DP rank's node: the bytes to and from servers there count as inter-node
        self.workers, self.me = C.size(ctx.dp_group), C.rank(ctx.dp_group)
        self.bounds = shard_bounds(sum(p.numel() for p in params), cfg.sync.servers)
        self.k = cfg.sync.max_staleness if cfg.sync.asynchronous else 0
        self.clock, self.version, self.bytes, self.inter_bytes = 0, 0, 0, 0
        self.state: dict[nn.Parameter, dict] = defaultdict(dict)  # none here: the servers hold it
        self.param_groups = [{"params": list(params)}]
        self.server: Optional[Server] = None
        self.thread: Optional[threading.Thread] = None
        self.restart(0)

    def restart(self, step: int) -> None:
        """A fresh server shard (this rank hosts one when its DP rank < S) from the parameters held now, at
        version `step`: a run's start, or a resume whose checkpoint holds no server state for this layout (its
        optimizer state starts afresh). Its thread starts with the first step."""
        if self.thread is not None:
            raise RuntimeError("a parameter server restarted while it serves")
        self.clock = self.version = self.base = step  # base: the first version this run's servers hold
        if self.me < len(self.bounds):
            flat = torch.cat([p.detach().float().cpu().reshape(-1) for p in self.params])  # servers: CPU, fp32
            self.server = Server(self.cfg, self.params, flat, self.bounds[self.me], self.workers, self.push,
                                 self.pull, self.me)
            self.server.version, self.server.snapshots = step, {step: self.server.params()}

    def step(self, lr: float) -> torch.Tensor:
        """Norm, clip, push the gradient's shards, pull the parameters' (the version this clock needs). A
        non-finite gradient is pushed as zeros (the servers' clock must advance: the run then stops on it)."""
        if self.server is not None and self.thread is None:  # the server's thread, and its receiver's
            self.thread = threading.Thread(target=self.server.run, name="hybrid-ps-server", daemon=True)
            self.thread.start()
            if self.workers > 1:
                threading.Thread(target=self.server.receive, name="hybrid-ps-receive", daemon=True).start()
        norm = global_grad_norm(self.params, self.ctx)
        ok = finite(norm)
        if ok:
            clip_grads(self.params, self.cfg.optim.grad_clip, norm)
        flat = torch.cat([grad_of(p).float().cpu().reshape(-1) if ok else torch.zeros(p.numel()) for p in self.params])
        last = self.clock + 1 == self.cfg.train.steps
        need = max(self.base, self.clock + 1 - (0 if last else self.k))
        header = torch.tensor([float(self.clock), float(self.version), lr, float(need)])
        replies = self._exchange([torch.cat([header, flat[lo:hi]]) for lo, hi in self.bounds])
        self._write(replies)
        self.clock += 1
        if last:  # every server may end: each push of a worker has its message size, the stop too
            self._send_all([torch.cat([torch.tensor([STOP, 0.0, 0.0, 0.0]), torch.zeros(hi - lo)])
                            for lo, hi in self.bounds], replied=False)
        return norm

    def _exchange(self, pushes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every shard's push out and reply in: the replies' receives posted first, then the pushes. A reply is
        counted (`ps`, `recv`) here, by the worker it reaches, when it arrives — inside this step, in the training
        thread — and every reply's wait timed as exposed `ps` time (the server thread that sends it counts nothing)."""
        replies = [torch.empty(1 + hi - lo) for lo, hi in self.bounds]
        recvs = [None if s == self.me else dist.irecv(r, group=self.pull, group_src=s) for s, r in enumerate(replies)]
        self._send_all(pushes)
        for s, work in enumerate(recvs):
            with C.TIMER.waiting(C.group_name(self.pull), "recv"):  # this rank's own server too: it waits for
                if work is None:  # every worker's push of the clock, as a remote one does
                    replies[s] = self._local_reply()
                else:
                    work.wait()
            if work is not None:
                C.COUNTER.record(C.group_name(self.pull), "recv", replies[s])
        return replies

    def _send_all(self, msgs: list[torch.Tensor], replied: bool = True) -> None:
        works = []
        for s, msg in enumerate(msgs):
            if s == self.me:
                self.server.inbox.put((self.me, msg))
                continue
            C.COUNTER.record(C.group_name(self.push), "send", msg)
            self.bytes += msg.numel() * 4
            if self.node_of(s) != self.node_of(self.me):  # the push out (and its reply back) cross nodes
                self.inter_bytes += (2 * msg.numel() - 3 if replied else msg.numel()) * 4
            works.append(dist.isend(msg, group=self.push, group_dst=s))
        with C.TIMER.waiting(C.group_name(self.push), "send"):
            for w in works:
                w.wait()

    def _local_reply(self) -> torch.Tensor:
        reply = self.server.local_out.get()
        if reply is None:
            raise RuntimeError(f"parameter server thread failed: {self.server.error}") from self.server.error
        return reply

    @torch.no_grad()
    def _write(self, replies: list[torch.Tensor]) -> None:
        flat = torch.cat([r[1:] for r in replies])
        self.version = min(int(r[0]) for r in replies)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))  # to the parameter's device and dtype
            offset += p.numel()

    # ---- the optimizer seam's other parts, and the sync object's ---------------------------------------------

    def main_weight(self, p: nn.Parameter) -> torch.Tensor:
        return p.detach()

    def loaded(self) -> None:
        """After a load wrote the parameters: nothing (the server shards restart from them: `restart`)."""

    def reload_main(self) -> None:
        """After `model.init_from`: nothing here (the trainer restarts the servers from the new weights)."""

    def after_step(self, step: int, last: bool = False) -> list[int]:
        return []  # the exchange is the optimizer's step

    def record(self, steps: int) -> dict[str, float]:
        """The oldest version a worker holds, the stalest gradient a server applied, the workers' push bytes and
        inter-node bytes per step (means over ranks). Collective: uncounted all-reduces."""
        stale = max(self.server.staleness, default=0) if self.server is not None else 0
        device = self.params[0].device
        sent, inter = over_ranks([self.bytes / max(steps, 1), self.inter_bytes / max(steps, 1)], device)
        (lag,), (worst,) = (over_ranks([v], device, dist.ReduceOp.MAX) for v in (self.clock - self.version, stale))
        return {"ps_lag": lag, "ps_max_staleness": worst, "bytes_outer_per_step": sent, "bytes_inter_per_step": inter}

    def state_dict(self) -> dict[str, Any]:
        """After this rank's server has applied every clock before this step (nothing in flight): the worker's
        parameters and version, and the server's shard, optimizer state and version."""
        out: dict[str, Any] = {"params": [p.detach().clone() for p in self.params], "version": self.version,
                               "clock": self.clock, "bytes": self.bytes, "inter_bytes": self.inter_bytes,
                               "base": self.base}
        if self.server is not None:
            self.server.wait_version(self.clock)
            out["server"] = {"slices": [t.detach().clone() for t in self.server.slices],
                             "optim": self.server.optimizer.state_dict(), "version": self.server.version,
                             "staleness": list(self.server.staleness), "snapshots": dict(self.server.snapshots)}
        return out

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for p, t in zip(self.params, sd["params"]):
            p.copy_(t)
        self.version, self.clock, self.bytes = int(sd["version"]), int(sd["clock"]), int(sd["bytes"])
        self.inter_bytes = int(sd["inter_bytes"])
        self.restart(int(sd["clock"]))
        self.version, self.base = int(sd["version"]), int(sd["base"])
        if self.server is not None:
            for t, v in zip(self.server.slices, sd["server"]["slices"]):
                t.copy_(v)
            self.server.optimizer.load_state_dict(sd["server"]["optim"])
            self.server.version, self.server.staleness = int(sd["server"]["version"]), sd["server"]["staleness"]
            self.server.snapshots = {int(v): t for v, t in sd["server"]["snapshots"].items()}


class ParameterServer:
    """`sync.mode=ps` (`sync=ps`, `sync=ps_async`): the workers' `PSWorker` is the optimizer (see the module doc)."""

    name = "ps"

    def check(self, cfg: Config, layout: Layout) -> None:
        s, t = cfg.sync, cfg.train
        check_replica_mode(cfg)
        require(s.servers >= 1, f"sync.servers must be >= 1, got {s.servers}")
        require(s.servers <= layout.dp, f"sync.servers={s.servers} is more than the DP ranks that host them "
                 f"(dp={layout.dp}): each server shard lives on one DP rank of each (pp, tp) coordinate")
        require(s.max_staleness >= 0, f"sync.max_staleness must be >= 0, got {s.max_staleness}")
        require(s.scope == "dp" and s.fragments == 1 and s.inner_steps == 1, "sync=ps exchanges every step over "
                 "DP: sync.scope=dp, sync.fragments=1, sync.inner_steps=1")
        require(cfg.compression.method == "none", f"sync=ps pushes fp32 gradients; compression="
                 f"{cfg.compression.method} applies to sync=dp and sync=diloco")
        require(t.precision != "bf16_params", "sync=ps keeps fp32 parameters on the servers: use train.precision="
                 "bf16 (autocast) or fp32")
        require(t.on_nonfinite == "stop", f"sync=ps stops on a non-finite gradient (the servers have applied the "
                 f"step's others): train.on_nonfinite={t.on_nonfinite} is not available with it")

    def build(self, cfg: Config, ctx: ParallelContext, model: nn.ModuleList, main: Optional[dict],
              hook: Any) -> DPPlan:
        """Pushes and replies each on groups of their own over the DP ranks (gloo: CPU, beside NCCL too)."""
        grad_sync = inner_sync(cfg, ctx, model, main)
        push, pull = (more_groups(ctx, "dp", "ps", backend="gloo") for _ in range(2))
        worker = PSWorker(cfg, ctx, trained(model), push, pull, node_of(ctx))
        return DPPlan(grad_sync, worker, replica=worker, replicas_group=inner_group(cfg, ctx), same_norm=False)

    def footprint(self, cfg: Config, params: Sequence[torch.Tensor], sizes: Sequence[int], dp: int, share: int,
                  device: str, host: bool) -> Footprint:
        """No optimizer on the worker; on CPU, while it pushes, the flat gradient, the pushes, the replies and
        their concatenation; on the host of a server shard (CPU runs only) the shard's `server_bytes`."""
        numel = sum(p.numel() for p in params)
        return Footprint(0, True, server_bytes(cfg, numel, dp) if device == "cpu" and host else 0,
                         4 * F32 * numel if device == "cpu" else 0)

    def startup(self, cfg: Config, layout: Layout) -> list[str]:
        return single_replica_note(cfg, layout.dp)


def server_bytes(cfg: Config, numel: int, dp: int) -> int:
    """A server shard's host (the largest shard): parameters, moments, k + 1 snapshots, the queued pushes of
    k + 1 clocks from every worker (each with its 4-element header) and the step's mean."""
    s, shard = cfg.sync, -(-numel // cfg.sync.servers)
    k = s.max_staleness if s.asynchronous else 0
    return F32 * (shard * (1 + optimizer_moments(cfg.optim) + (k + 1) + 1) + (k + 1) * dp * (shard + 4))


PARAMETER_SERVER = register_sync_mode(ParameterServer())
