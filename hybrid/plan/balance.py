"""Automatic stage balance (`parallel.stage_layers=auto`): the layers split over the pipeline's model parts so that
each part's predicted microbatch time — its layers, plus the token embedding on the first part and the head and
loss on the last — is as even as whole layers allow, not only the layer counts.

The times are the planner's cost model (`cost`) on the run's device (`hardware.local_device`) for the run's
microbatch, TP, CP, recomputation and TP overlap: a GPT-2-sized vocabulary's head costs several layers, so the
last part gets fewer layers than the others (Megatron-LM's `--account-for-loss-in-pipeline-split` counts it as one
layer). The split is resolved once at start-up, before any model is built; the checkpoint records the list.
"""

from __future__ import annotations

from typing import Optional

from hybrid.config import Config
from hybrid.parallel.pp.pipeline import partition_layers
from hybrid.plan.cost import Micro, Pass, Shape, embed_pass, head_pass, layer_pass, shape_of
from hybrid.plan.hardware import LINKS, Device, Link, local_device

AUTO = "auto"


def balance(n_layers: int, parts: int, layer: float, first: float, last: float) -> list[int]:
    """Layers per part minimising the costliest part (a part: its layers at `layer` each, plus `first` on part 0
    and `last` on the last part); middle parts keep a layer, the first and last may be empty. Of the splits
    reaching that cost, layers are taken off the costliest parts first (the earliest on a tie: 1F1B's first stage
    holds the most activations)."""
    if parts == 1 or layer <= 0:
        return [len(r) for r in partition_layers(n_layers, parts)]
    extra = [first] + [0.0] * (parts - 2) + [last]
    least = [0] + [1] * (parts - 2) + [0]
    bound = _least_bound(n_layers, layer, extra, least)
    counts = _capacities(bound, layer, extra)
    for _ in range(sum(counts) - n_layers):
        i = max((j for j in range(parts) if counts[j] > least[j]), key=lambda j: (counts[j] * layer + extra[j], -j))
        counts[i] -= 1
    return counts


def _capacities(bound: float, layer: float, extra: list[float]) -> list[int]:
    """The most layers each part takes without costing more than `bound`."""
    return [max(0, int((bound - e) / layer + 1e-9)) for e in extra]


def _least_bound(n_layers: int, layer: float, extra: list[float], least: list[int]) -> float:
    """The smallest part cost (a part's extra plus whole layers) at which the parts hold every layer."""
    bounds = sorted({e + k * layer for e in extra for k in range(n_layers + 1)})

    def holds(b: float) -> bool:
        caps = _capacities(b, layer, extra)
        return sum(caps) >= n_layers and all(c >= m for c, m in zip(caps, least))

    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(bounds[mid]) else (mid + 1, hi)
    return bounds[lo]


def passes(shape: Shape, m: Micro, dev: Device, recompute: str, overlap: str, link: Link, kernel: str = "flash",
           cp_link: Optional[Link] = None) -> tuple[Pass, Pass, Pass]:
    """(one layer's, the embedding's, the head's) microbatch pass (`cost`; TP over `link`, CP over `cp_link`)."""
    layer = layer_pass(shape, m, dev, recompute, overlap, link, kernel, cp_link)
    return layer, embed_pass(shape, m, dev, link), head_pass(shape, m, dev, link)


def split(n_layers: int, parts: int, layer: Pass, embed: Pass, head: Pass) -> list[int]:
    """Layers per part evening the parts' predicted seconds (`balance` of the passes' totals)."""
    return balance(n_layers, parts, seconds(layer), seconds(embed), seconds(head))


def part_passes(cfg: Config, vocab: int, device_type: str, where: Optional[tuple[Device, Link]] = None
                ) -> tuple[Pass, Pass, Pass]:
    """(one layer's, the embedding's, the head's) predicted microbatch pass of a run of `cfg` on `device_type`: on
    the device and links `where` says (the planner's cluster), else this machine's as the table knows them."""
    p, t = cfg.parallel, cfg.train
    act = 2 if device_type == "cuda" and t.precision != "fp32" else 4
    m = Micro(t.micro_batch_size, cfg.data.seq_len, p.tp, p.cp, act, p.sequence_parallel and p.tp > 1)
    dev, link = where or (local_device(device_type), LINKS["nvlink4" if device_type == "cuda" else "gloo-local"])
    return passes(shape_of(cfg.model, vocab), m, dev, t.recompute, p.tp_overlap, link)


def passes_of(counts: list[int], layer: Pass, embed: Pass, head: Pass) -> list[Pass]:
    """Each part's microbatch pass: its layers, the embedding's on the first part, the head's on the last."""
    none, last = Pass(0.0, 0.0), len(counts) - 1
    return [layer.times(n) + (embed if i == 0 else none) + (head if i == last else none) for i, n in enumerate(counts)]


def seconds(one: Pass) -> float:
    return sum(one.clocked())


def auto_stage_layers(cfg: Config, vocab: int, device_type: str, where: Optional[tuple[Device, Link]] = None
                      ) -> list[int]:
    """`cfg`'s layers per model part (pp · virtual stages) evened by predicted time (see the module doc)."""
    parts = cfg.parallel.pp * cfg.parallel.virtual_stages
    return split(cfg.model.n_layers, parts, *part_passes(cfg, vocab, device_type, where))


def resolve(cfg: Config, vocab: int, device_type: str, where: Optional[tuple[Device, Link]] = None) -> str:
    """Replace `parallel.stage_layers=auto` in `cfg` by the split it means; one start-up line saying so (else '')."""
    if cfg.parallel.stage_layers != AUTO:
        return ""
    passed = part_passes(cfg, vocab, device_type, where)
    counts = split(cfg.model.n_layers, cfg.parallel.pp * cfg.parallel.virtual_stages, *passed)
    cfg.parallel.stage_layers = counts
    layer, embed, head = (seconds(x) for x in passed)
    return (f"stage balance (parallel.stage_layers=auto): layers per part {counts}; predicted, the embedding costs "
            f"{embed / layer:.2f} layer(s) and the head and loss {head / layer:.2f}")
