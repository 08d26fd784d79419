"""One layout's predicted step: the stages' microbatch costs (`cost`) replayed by the pipeline simulator, the DP
gradient exchange (overlapped with the last microbatch's backward), the optimizer, and the step's parts.

The model's layers are split over the pp·v parts as `parallel.stage_layers` would split them (`balance`: auto, by
predicted time — the default —, or equal counts), the embedding on the first part and the head on the last; the
simulator replays each part at its own cost, and the slowest rank's parts are the step's breakdown. Gradients are
averaged (and ZeRO shards) over the dp·cp ranks a tp stride apart, which cross nodes when tp·cp·dp ranks do not
fit in one; CP's ring runs over the cp ranks a tp stride apart; consecutive pipeline stages sit tp·cp·dp ranks apart
(the `tp-cp-dp-pp` rank order) and talk across nodes when that stride reaches a node.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace

from hybrid.config import ParallelConfig
from hybrid.parallel.pp.actions import Schedule
from hybrid.parallel.pp.pipeline import partition_layers
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.parallel.pp.simulator import simulate
from hybrid.plan import balance, exchange, tail
from hybrid.plan.cost import Micro, Pass, Shape, collective_s, optimizer_s, p2p_s
from hybrid.plan.hardware import Cluster

BUCKET_ELEMENTS = ParallelConfig.bucket_mb * 2**20 / 4  # a DP bucket's fp32 gradients (the default size)


@dataclass(frozen=True)
class Candidate:
    """A layout and the knobs that change a step's time or memory."""

    tp: int
    pp: int
    dp: int
    micro: int = 1
    cp: int = 1
    v: int = 1  # virtual stages (the interleaved schedule when > 1)
    recompute: str = "none"
    zero: int = 1
    tp_overlap: str = "chunked"
    sequence_parallel: bool = True
    dp_overlap: bool = True  # the gradient exchange launched bucket by bucket inside the backward
    dp_exchange: str = "flat"  # flat | hierarchical | int8 (`exchange`), or auto: the fastest exact one (or int8)
    stage_layers: str = "auto"  # auto (layers over the parts by predicted time) | equal (equal layer counts)

    @property
    def schedule(self) -> str:
        return "interleaved" if self.v > 1 else "1f1b"

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"cp{self.cp}" if self.cp > 1 else "", f"pp{self.pp}", f"dp{self.dp}"]
        v = f" v{self.v}" if self.v > 1 else ""
        dp = f" {self.dp_exchange}" if self.dp_exchange not in ("flat", "auto") else ""
        return f"{''.join(parts)}{v} mb{self.micro} {self.recompute} zero{self.zero}{dp}"

    def overrides(self) -> list[str]:
        """The `hybrid.train` overrides of this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
               f"train.micro_batch_size={self.micro}", f"train.recompute={self.recompute}",
               f"parallel.zero={self.zero}"]
        out += [f"parallel.cp={self.cp}"] if self.cp > 1 else []
        out += [f"parallel.schedule={self.schedule}", f"parallel.virtual_stages={self.v}"] if self.pp > 1 else []
        out += ["parallel.stage_layers=auto"] if self.pp > 1 and self.stage_layers == "auto" else []
        out += ["parallel.sequence_parallel=true"] if self.sp else []
        out += [f"parallel.tp_overlap={self.tp_overlap}"] if self.tp > 1 else []
        return out + exchange.overrides(self.dp_exchange, self.zero)


@dataclass
class Prediction:
    """A layout's step: seconds and their parts (means per rank of the slowest stage), bytes a rank sends per
    group, and, once estimated, the largest stage's memory."""

    candidate: Candidate
    step_s: float
    parts: dict[str, float]
    bytes: dict[str, float]
    tokens: int  # per step, the whole cluster
    world: int
    flops_per_token: float
    peak: float
    memory: int = 0
    fits: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_s / self.world

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.flops_per_token / self.peak

    def to_json(self) -> dict[str, object]:
        return {"layout": asdict(self.candidate), "label": self.candidate.label(), "step_s": self.step_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "parts": self.parts,
                "bytes_per_rank": self.bytes, "memory_per_rank": self.memory, "fits": self.fits,
                "overrides": self.candidate.overrides()}


def part_passes(shape: Shape, c: Candidate, m: Micro, cluster: Cluster, kernel: str) -> list[Pass]:
    """Each model part's microbatch pass: its layers (split as `c.stage_layers` says), the embedding's on the first
    part, the head's on the last."""
    layer, embed, head = balance.passes(shape, m, cluster.device, c.recompute, c.tp_overlap,
                                        link_of_group(cluster, c.tp, 1), kernel, link_of_group(cluster, c.cp, c.tp))
    parts = c.pp * c.v
    counts = (balance.split(shape.layers, parts, layer, embed, head) if c.stage_layers == "auto"
              else [len(r) for r in partition_layers(shape.layers, parts)])
    return balance.passes_of(counts, layer, embed, head)


def rank_passes(c: Candidate, parts: list[Pass]) -> list[Pass]:
    """Each pipeline rank's microbatch pass over its chunks (chunk k of rank r holds part k·pp + r)."""
    return [sum((parts[k * c.pp + r] for k in range(c.v)), Pass(0.0, 0.0)) for r in range(c.pp)]


def link_of_group(cluster: Cluster, size: int, stride: int):  # noqa: ANN201 - a Link
    """The links a group of `size` ranks `stride` apart crosses: inside a node when they fit in one."""
    return cluster.intra if size * stride <= cluster.per_node else cluster.inter


def predict(shape: Shape, c: Candidate, cluster: Cluster, global_batch: int, seq: int, act: int = 2,
            kernel: str = "flash", lossy: bool = False, replay: bool = True) -> Prediction:
    """The step of `c` training `shape` on `cluster`, `global_batch` sequences of `seq` tokens, attention by
    `kernel` (`cost.ATTENTION`); a DP exchange `auto` becomes the fastest exact one (`lossy`: int8 too). Without
    `replay` the pipeline is only its busiest rank's work (no bubble): a lower bound of the step, without the
    simulator."""
    if c.dp_exchange == "auto":
        chosen = exchange.best(c.dp * c.cp, c.tp, c.zero, stage_elements(shape, c), cluster, lossy, BUCKET_ELEMENTS)
        c = replace(c, dp_exchange=chosen.method)
    m = Micro(c.micro, seq, c.tp, c.cp, act, c.sp)
    count = global_batch // (c.micro * c.dp)
    per_part = part_passes(shape, c, m, cluster, kernel)
    ranks = rank_passes(c, per_part)
    slowest = max(ranks, key=balance.seconds)
    p2p = p2p_s(m, shape.hidden, link_of_group(cluster, 2, c.tp * c.cp * c.dp)) * (c.pp > 1)
    pipeline = _pipeline_s(c, count, per_part, p2p) if replay else count * balance.seconds(slowest)
    grads = stage_segments(shape, c)
    parts = _parts(c, cluster, count, slowest, pipeline, grads, act)
    parts["p2p"] = p2p
    step = parts["pipeline"] + parts["dp_exposed"] + parts["optimizer"]
    if cluster.device.cores and cluster.per_node >= cluster.device.cores:  # CPU ranks with no core to spare
        mean = sum(ranks, Pass(0.0, 0.0)).times(1 / c.pp)  # a rank's share of the work
        shared = _shared_s(c, cluster, count, mean, p2p, parts, grads, act)
        parts["shared_cores"] = max(0.0, shared - step)
        step += parts["shared_cores"]
    return Prediction(c, step, parts, wire_bytes(shape, c, m, count), global_batch * seq,
                      c.tp * c.cp * c.pp * c.dp, shape.flops_per_token(seq), cluster.device.peak)


def _parts(c: Candidate, cluster: Cluster, count: int, stage: Pass, pipeline: float, grads: list[tail.Segment],
           act: int) -> dict[str, float]:
    """The step's parts on the slowest stage: the pipeline (the simulator's makespan), of it compute, exposed TP and
    bubble; the DP exchange (all of it, and what the backward leaves exposed; ZeRO-3's parameter all-gathers, each
    behind the pass it feeds); the optimizer (Adam, ZeRO-1's and ZeRO-2's parameter all-gather)."""
    forward, backward = stage.clocked()
    elements = tail.total(grads)
    dp_total, dp_exposed = _dp_s(c, cluster, grads, backward / c.v, count)
    shards = c.dp * c.cp  # the ranks that average gradients (and ZeRO's shards): DP's and CP's
    gather = _param_gather_s(c, cluster, elements, act)
    if c.zero == 3:  # parameters gathered before each microbatch's forward and again before its backward
        dp_total += 2 * count * gather
        dp_exposed += count * (max(0.0, gather - forward) + max(0.0, gather - backward))
    optimizer = optimizer_s(elements / (shards if c.zero else 1), cluster.device) + gather * (c.zero in (1, 2))
    compute, exposed = count * (stage.forward + stage.backward), count * (stage.tp_exposed + stage.cp_exposed)
    return {"pipeline": pipeline, "compute": compute, "tp_exposed": count * stage.tp_exposed,
            "cp_exposed": count * stage.cp_exposed, "bubble": max(0.0, pipeline - compute - exposed),
            "dp_total": dp_total, "dp_exposed": dp_exposed, "optimizer": optimizer,
            "param_gather": gather * (c.zero in (1, 2)),
            "tp_total": count * stage.tp_total, "cp_total": count * stage.cp_total}


def _shared_s(c: Candidate, cluster: Cluster, count: int, stage: Pass, p2p: float, parts: dict[str, float],
              grads: list[tail.Segment], act: int) -> float:
    """A step when a node's ranks have no core to spare (CPU: as many ranks as cores, or more): the compute of all of
    them over the cores — a rank that waits frees its core, so a bubble costs nothing while others have work — plus
    every exchange's time as measured under that contention, hidden or not (its copies take the cores the compute
    needs: no exchange overlaps); across nodes, the DP exchange's and ZeRO's gather's wire time instead of their
    copies where it is the longer (`_dp_shared_s`)."""
    ratio = cluster.per_node / cluster.device.cores
    work = count * (stage.forward + stage.backward) * ratio
    exchanges = count * (stage.tp_total + stage.cp_total + 2 * c.v * p2p)  # a hop each way per chunk
    local = replace(cluster, inter=cluster.intra)  # every group's copies over the node's own link
    dp = _dp_shared_s(c, cluster, local, grads, stage.backward / c.v * ratio, count)
    gather = _param_gather_s(c, local, tail.total(grads), act) * (c.zero in (1, 2))
    adam = parts["optimizer"] - parts["param_gather"]
    return work + exchanges + dp + adam * ratio + max(gather * ratio, parts["param_gather"])


def _dp_shared_s(c: Candidate, cluster: Cluster, local: Cluster, grads: list[tail.Segment], backward: float,
                 count: int) -> float:
    """Under shared cores, the DP exchange: its copies over the node's own link (`local`) in full (the cores run
    them) — or, when the group crosses nodes and the wire takes longer, the part of the exchange over the real links
    that the backward (its wall time here) does not hide. A codec's passes share the cores as the compute does."""
    ratio = cluster.per_node / cluster.device.cores
    shared, local = (replace(k, device=replace(k.device, hbm=k.device.hbm / ratio)) for k in (cluster, local))
    copies = _dp_s(c, local, grads, backward, count)[0]
    total, exposed = _dp_s(c, shared, grads, backward, count)
    return max(copies, exposed) if total > copies else copies


def _param_gather_s(c: Candidate, cluster: Cluster, elements: float, act: int) -> float:
    """One all-gather of a rank's parameters (`act` bytes each) over the dp·cp ranks that shard them."""
    grads = c.dp * c.cp
    return collective_s("all_gather", elements * act, grads, link_of_group(cluster, grads, c.tp))


def wire_bytes(shape: Shape, c: Candidate, m: Micro, count: int) -> dict[str, float]:
    """Bytes one rank of the largest stage puts on the wire a step, per group: TP's exchanges (under SP 10 of the
    residual stream a layer, forward and backward, 4 all-reduces without; the full recomputation's forward again),
    PP's hidden states and their gradients, DP's (`dp_bytes`)."""
    stream = m.tokens * shape.hidden * m.act
    per_layer = (10 if c.sp else 8) * stream * (c.tp - 1) / c.tp * (1 + (c.recompute == "full") * 0.4)
    pp = 2 * count * stream / (c.tp if c.sp else 1) if c.pp > 1 else 0.0
    return {"tp": count * per_layer * shape.layers / c.pp, "pp": pp,
            "dp": dp_bytes(c, stage_elements(shape, c), m.act, count)}


def dp_bytes(c: Candidate, elements: float, act: int, count: int) -> float:
    """A rank's DP bytes a step, the ring's (n − 1)/n of each payload over the dp·cp ranks: without ZeRO the fp32
    gradients' all-reduce (twice); ZeRO-1 their reduce-scatter and the parameters' all-gather (`act` bytes);
    ZeRO-2 a reduce-scatter every microbatch; ZeRO-3 also two parameter all-gathers a microbatch, none after."""
    grads = c.dp * c.cp
    share = elements * (grads - 1) / grads
    if c.zero == 0:
        return 2 * 4 * share
    scatters = count if c.zero >= 2 else 1
    gathers = 2 * count if c.zero == 3 else 1
    return scatters * 4 * share + gathers * act * share


def _pipeline_s(c: Candidate, count: int, parts: list[Pass], p2p: float) -> float:
    """The pipeline's makespan from the simulator, each part at its cost with its exposed exchanges (`Pass.clocked`;
    one stage: every microbatch in turn)."""
    costs = [p.clocked() for p in parts]
    if c.pp == 1:
        return count * sum(f + b for f, b in costs)
    return simulate(_schedule(c.schedule, c.pp, count, c.v), comm=p2p, parts=costs).makespan


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, v: int) -> Schedule:
    """One schedule object per shape: the simulator checks and wires it once for every layout replayed on it."""
    return build_schedule(name, pp, microbatches, v)


def stage_elements(shape: Shape, c: Candidate) -> float:
    """Parameters a rank of the largest stage holds (its layers', the embedding's and, one stage holding an untied
    head too, the head's; over tp)."""
    return tail.total(stage_segments(shape, c))


def stage_segments(shape: Shape, c: Candidate) -> list[tail.Segment]:
    """The gradients of a rank of the first stage (the largest: its embedding's backward ends last) in the order its
    last backward finishes them (`tail`): its other chunks' layers and an untied head's (one stage) already final,
    the last chunk's layer by layer, the embedding's at the end."""
    layer, embedding = shape.layer_params() / c.tp, shape.vocab * shape.hidden / c.tp
    chunk = shape.layers / (c.pp * c.v)  # layers a chunk holds (a fraction when the stages outnumber them)
    steps = max(1, round(chunk))
    early = (shape.layers / c.pp - chunk) * layer + embedding * (c.pp == 1 and not shape.tied)
    return tail.segments(chunk * layer / steps, steps, embedding, early)


def _dp_s(c: Candidate, cluster: Cluster, grads: list[tail.Segment], backward: float, count: int
          ) -> tuple[float, float]:
    """(the gradient exchange's seconds, what the backward does not hide): the fp32 gradients `grads` (a rank's, in the
    order the backward finishes them) exchanged over DP by `c.dp_exchange` (`exchange`), launched bucket by bucket
    as the backward makes them — once a step behind the last microbatch's backward, or (ZeRO-2 and 3: only shards
    are kept) every microbatch behind its own, each bucket its own exchange. The flat exchange runs behind 0.9 of
    that backward (the exchange slows the compute it overlaps), its tail exposed as the buckets queue on the link
    (`tail`; never less than 1/16 of it); the two-hop and int8 hooks wait for each bucket's exchange across nodes
    inside the backward (`compression/hierarchical.py`), so nothing of theirs is hidden."""
    if c.dp * c.cp == 1:
        return 0.0, 0.0
    timed = exchange_timed(c, tail.total(grads), cluster)
    one, rounds = timed.get(c.dp_exchange, timed["flat"]), count if c.zero >= 2 else 1
    hidden = c.dp_overlap and c.dp_exchange in ("flat", "auto")
    queued = tail.exposed(grads, one, 0.9 * backward, BUCKET_ELEMENTS, per_unit=c.zero > 0)
    return rounds * one, rounds * (max(queued, one / 16) if hidden else one)


def exchange_seconds(c: Candidate, shape: Shape, cluster: Cluster) -> dict[str, float]:
    """Seconds of every DP exchange `c`'s group can run (what the chosen one saves against the others)."""
    return exchange_timed(c, stage_elements(shape, c), cluster) if c.dp * c.cp > 1 else {}


def exchange_timed(c: Candidate, elements: float, cluster: Cluster) -> dict[str, float]:
    """Seconds of every DP exchange of `elements` gradient elements, bucket by bucket (`exchange.options`)."""
    return {e.method: e.seconds for e in exchange.options(c.dp * c.cp, c.tp, c.zero, elements, cluster,
                                                          BUCKET_ELEMENTS)}
