"""Every layout a cluster can run a model in, ranked by predicted step time, each checked against memory. Candidates:
tp a power of two inside a node dividing the heads, KV heads and FFN; cp 1, 2, 4 or 8 inside the node with tp (2·cp
dividing the sequence); pp dividing the layers (and the world with tp and cp); dp the rest; micro batches dividing
each DP rank's share of the global batch (up to 16); 1F1B, and the interleaved schedule with 2 virtual stages where
the parts and microbatches allow it; recomputation none, selective or full; ZeRO-1 (the distributed optimizer), 2 or
3 where dp·cp > 1. They are predicted (`predict`: analytic costs, the simulator's pipeline; each with the fastest
exact DP exchange its links allow, int8 across nodes too when lossy exchanges are allowed) fastest first — each
bounded below without the simulator, and replayed only while it might still be among the fastest (`fastest`) —; the
fastest are then estimated (`hybrid.memory`, each stage's first rank built on the meta device, the first and last
stages: the embedding's and the head's, the largest) in order until `top` fit the device with 10 % to spare.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from hybrid.config import Config, compose_config
from hybrid.memory import Build, micro_of, rank_memory, shard_dp, training_schedule
from hybrid.overrides import parse
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.plan.balance import resolve
from hybrid.plan.cost import Shape
from hybrid.plan.hardware import Cluster, PlanError
from hybrid.plan.predict import Candidate, Prediction, predict

HEADROOM = 0.9  # of the device's memory a plan may fill (the CUDA context, the allocator's fragmentation)
MAX_MICRO = 16
RECOMPUTE = ("none", "selective", "full")
Builder = Callable[[Config], Build]  # a config → its chunks' builder (`trainer.build_chunks` bound to a vocabulary)
Checker = Callable[[Config, int], object]  # raises on a config the world cannot run (`validation.validate`)


@dataclass(frozen=True)
class Job:
    """What to train: the model's config (its `train`, `data` and `parallel` sections are set per candidate),
    the global batch in sequences and the sequence length."""

    cfg: Config
    shape: Shape
    global_batch: int
    seq: int
    kernel: str = "flash"  # the attention kernel the step runs (`cost.ATTENTION`)


def candidates(shape: Shape, cluster: Cluster, global_batch: int, seq: int = 0) -> Iterator[Candidate]:
    """Every layout (see the module doc); CP sizes only given the sequence (`seq`), which 2·cp must divide."""
    world, d = cluster.world, shape.hidden // shape.heads
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= cluster.per_node and _divides(shape, t)):
        for cp in (c for c in (1, 2, 4, 8) if c == 1 or (tp * c <= cluster.per_node and seq and seq % (2 * c) == 0)):
            for pp in (p for p in range(1, shape.layers + 1) if shape.layers % p == 0 and world % (tp * cp * p) == 0):
                dp = world // (tp * cp * pp)
                if global_batch % dp or d < 1:
                    continue
                yield from _knobs(shape, tp, cp, pp, dp, global_batch // dp)


def _divides(shape: Shape, tp: int) -> bool:
    return shape.heads % tp == 0 and shape.kv_heads % tp == 0 and shape.ffn % tp == 0


def _knobs(shape: Shape, tp: int, cp: int, pp: int, dp: int, per_dp: int) -> Iterator[Candidate]:
    for micro in (b for b in range(1, min(per_dp, MAX_MICRO) + 1) if per_dp % b == 0):
        count = per_dp // micro
        for v in (1, 2) if pp > 1 else (1,):
            if v > 1 and (shape.layers % (pp * v) or count % pp):
                continue
            for recompute, zero in itertools.product(RECOMPUTE, (1, 2, 3) if dp * cp > 1 else (0,)):
                yield Candidate(tp, pp, dp, micro, cp=cp, v=v, recompute=recompute, zero=zero, dp_exchange="auto")


MAX_ESTIMATES = 120  # memory estimates a plan makes, fastest layouts first, before it gives up


def plan(job: Job, cluster: Cluster, builder: Builder, top: int = 5, check: Optional[Checker] = None,
         lossy: bool = False, layouts: Optional[list[Candidate]] = None) -> tuple[list[Prediction], int]:
    """(the `top` fastest layouts that fit, fastest first; how many layouts were considered). None fitting: a
    PlanError saying how far the leanest layout is from fitting. `check`: a layout whose config it refuses
    (`validation.validate`: what `hybrid.train` would refuse) is skipped. `layouts`: these instead of every
    candidate."""
    layouts = list(candidates(job.shape, cluster, job.global_batch, job.seq)) if layouts is None else layouts
    if not layouts:
        raise PlanError(f"no layout divides {cluster.world} ranks and the global batch of {job.global_batch} "
                        f"(tp must divide the {job.shape.heads} heads, pp the {job.shape.layers} layers)")
    fitting: list[Prediction] = []
    tried: list[Prediction] = []
    for p in fastest(job, cluster, layouts, lossy):  # fastest first, until `top` run and fit
        tried.append(p)
        if (check is None or _runs(job, p, cluster, check)) and _estimated(job, p, cluster, builder).fits:
            fitting.append(p)
        if len(fitting) == top or len(tried) == MAX_ESTIMATES:
            break
    if not fitting and all(p.notes for p in tried):  # refused for another reason than memory: say which
        raise PlanError(f"hybrid.train refuses every layout tried, e.g. {tried[0].candidate.label()}: "
                        f"{tried[0].notes[0]}")
    if not fitting:
        raise no_fit_error(job, cluster, layouts, builder)
    return fitting, len(layouts)


def fastest(job: Job, cluster: Cluster, layouts: list[Candidate], lossy: bool = False) -> Iterator[Prediction]:
    """The layouts' predictions, fastest first, each replayed only when needed: layouts go in order of their lower
    bound (`predict` without the pipeline's bubble), and a prediction is yielded once no layout left can beat it."""
    def one(c: Candidate, replay: bool) -> Prediction:
        return predict(job.shape, c, cluster, job.global_batch, job.seq, kernel=job.kernel, lossy=lossy,
                       replay=replay)

    heap: list[tuple[float, int, Prediction]] = []
    for i, (bound, c) in enumerate(sorted(((one(c, False).step_s, c) for c in layouts), key=lambda t: t[0])):
        while heap and heap[0][0] <= bound:
            yield heapq.heappop(heap)[2]
        p = one(c, True)
        heapq.heappush(heap, (p.step_s, i, p))
    while heap:
        yield heapq.heappop(heap)[2]


def _runs(job: Job, p: Prediction, cluster: Cluster, check: Checker) -> bool:
    try:
        check(configured(job, p.candidate, cluster), cluster.world)
    except ValueError as e:  # ConfigError, LayoutError, ScheduleError: hybrid.train would refuse it
        p.notes.append(str(e))
        return False
    return True


def _estimated(job: Job, p: Prediction, cluster: Cluster, builder: Builder) -> Prediction:
    p.memory = peak_memory(job, p.candidate, cluster, builder)
    p.fits = p.memory <= HEADROOM * cluster.device.memory
    return p


def configured(job: Job, c: Candidate, cluster: Cluster) -> Config:
    """The job's config with `c`'s overrides (bf16 parameters: fp32 main weights and gradients): a config group's
    option (`compression=int8`) as that group composed, a value as Hydra reads it."""
    cfg = copy.deepcopy(job.cfg)
    words = [*c.overrides(), f"train.global_batch_size={job.global_batch}", f"data.seq_len={job.seq}",
             "train.precision=bf16_params", f"model.max_seq_len={max(job.seq, job.cfg.model.max_seq_len)}",
             f"parallel.ranks_per_node={cluster.per_node}"]
    for o, word in zip(parse(words), words):
        if "." not in o.key_or_group:
            setattr(cfg, o.key_or_group, copy.deepcopy(getattr(compose_config([word]), o.key_or_group)))
        else:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
    resolve(cfg, job.shape.vocab, cluster.device.kind, (cluster.device, cluster.intra))  # stage_layers=auto
    return cfg


def peak_memory(job: Job, c: Candidate, cluster: Cluster, builder: Builder) -> int:
    """The estimate of the largest of the first and the last stage's ranks (bytes)."""
    cfg = configured(job, c, cluster)
    layout = Layout.create(cluster.world, tp=c.tp, pp=c.pp, dp=c.dp, cp=c.cp, ranks_per_node=cluster.per_node,
                           allow_tp_across_nodes=True)
    build, ranks = builder(cfg), sorted({0, c.pp - 1})
    m = micro_of(cfg, cluster.device.kind)
    schedule = training_schedule(cfg, layout, [], m)
    return max(rank_memory(cfg, _meta(build, layout, r), schedule, r, shard_dp(cfg, layout), m,
                           layout.dp_per_node).total for r in ranks)


def _meta(build: Build, layout: Layout, pp_rank: int):  # noqa: ANN202 - the rank's chunks
    import torch

    with torch.device("meta"):
        return build(ParallelContext.shapes(layout, layout.rank(pp_rank, 0, 0)))


def no_fit_error(job: Job, cluster: Cluster, layouts: list[Candidate], builder: Builder) -> PlanError:
    """How far the leanest layouts (full recomputation, micro batch 1, ZeRO-3, the most model parallelism) are from
    fitting, and the smallest fix: how many times more nodes would spread the states that far."""
    lean = sorted(layouts, key=lambda c: (c.recompute != "full", c.micro, -c.zero, -c.tp * c.cp * c.pp))[:4]
    predicted = (predict(job.shape, c, cluster, job.global_batch, job.seq) for c in lean)
    best = min((_estimated(job, p, cluster, builder) for p in predicted), key=lambda p: p.memory)
    need = best.memory / (HEADROOM * cluster.device.memory)
    return PlanError(f"no layout of {len(layouts)} fits: the leanest ({best.candidate.label()}) needs "
                     f"{best.memory / 2**30:.1f} GiB a rank, {need:.1f}× the {HEADROOM:.0%} of "
                     f"{cluster.device.memory / 2**30:.0f} GiB a plan may fill; at least {need:.1f}× the devices "
                     f"(--nodes {cluster.nodes * max(2, int(need + 0.999))}) or a larger device")
