"""What the compression benchmarks share: the methods they compare, a model's DP buckets (as the trainer cuts
them) and the library's payload formula of one gradient sync, per DP group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.bench.inputs import resolve_vocab
from hybrid.compression import codecs, powersgd, scaling
from hybrid.compression.hierarchical import piece_shapes, row_ranges
from hybrid.compression.registry import REGISTRY
from hybrid.config import CompressionConfig, compose_config
from hybrid.model import build_model
from hybrid.parallel.dp.buckets import assign_buckets

MIB, GIB, GB = 2**20, 2**30, 1e9

BYTES_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ("compression=none",)),
    ("fp16", ("compression=fp16",)),
    ("bf16", ("compression=bf16",)),
    ("int8", ("compression=int8",)),
    ("int4", ("compression=int4",)),
    ("sign", ("compression=sign",)),
    ("topk", ("compression=topk", "compression.fraction=0.01")),
    ("powersgd", ("compression=powersgd", "compression.rank=4")),
    ("powersgd fixed", ("compression=powersgd", "compression.rank=4", "compression.target_error=0",
                        "compression.factor_dtype=fp32")),  # PyTorch's
    ("torch_fp16", ("compression=torch_fp16",)),
    ("torch_powersgd", ("compression=torch_powersgd", "compression.rank=4")),  # its config: warmup_steps=2
    ("hier+int8", ("compression=hierarchical", "compression.inner=int8")),
    ("hier+powersgd", ("compression=hierarchical", "compression.inner=powersgd", "compression.rank=4")),
)
"""Every method of the bytes benchmark, with its config overrides (the speed benchmark's ratios use them too)."""
SPEED_METHODS = ("fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd")
TWO_PHASE = ("int8", "int4", "sign", "topk")
"""The codecs' methods: all-to-all of encoded chunks, then all-gather of the re-encoded reduced chunk."""


def compression_cfg(overrides: Sequence[str]) -> CompressionConfig:
    """The composed `compression` config of `overrides` (composed in the parent: Hydra is slow in ranks)."""
    return compose_config(list(overrides)).compression


def bucket_params(model: str) -> tuple[list[list[torch.nn.Parameter]], float]:
    """`model`'s parameters (meta device: no memory) cut into the trainer's DP buckets; and the bucket_mb used."""
    cfg = compose_config([f"model={model}"])
    with torch.device("meta"):
        net = build_model(cfg.model, resolve_vocab(cfg, None), None, seed=0)
    params = [p for p in net.parameters() if p.requires_grad]
    return assign_buckets(params, int(cfg.parallel.bucket_mb * MIB)), cfg.parallel.bucket_mb


def bucket_shapes(model: str) -> list[list[torch.Size]]:
    """The gradient shapes of each DP bucket of `model`, in bucket order."""
    return [[p.shape for p in ps] for ps in bucket_params(model)[0]]


def flat_payload(method: str, ccfg: CompressionConfig, shapes: list[torch.Size], numel: int, n: int) -> int:
    """The library's payload formula of one bucket of `numel` elements (`shapes`) for a flat method over n ranks."""
    if n == 1:
        return 0
    if method == "none":
        return 4 * numel
    if method in ("fp16", "bf16", "torch_fp16", "torch_bf16"):
        return 2 * numel
    if method in ("powersgd", "torch_powersgd"):  # ours probes its error under an adaptive rank
        ours = method == "powersgd"
        return powersgd.payload_bytes(shapes, ccfg.rank, ccfg.min_compression_rate, probed=ours and ccfg.target_error
                                      > 0, factor_bytes=powersgd.factor_bytes(ccfg) if ours else 4)
    codec = REGISTRY[method](ccfg, None)[1].codec  # the codec the method's factory builds
    return codecs.payload_bytes(codec, numel, n) + stats_payload(method, ccfg, shapes)


def stats_payload(method: str, ccfg: CompressionConfig, shapes: list[torch.Size]) -> int:
    """The factored scale's statistics all-reduce of one bucket (`scaling.stats_bytes`), where `method` runs it."""
    return scaling.stats_bytes(shapes) if scaling.scaled(ccfg, method) else 0


def formula_payload(ccfg: CompressionConfig, buckets: list[list[torch.Size]], n: int, per_node: int,
                    rank: int) -> dict[str, int]:
    """Payload bytes per DP group of one sync step on DP rank `rank` of n (per_node ranks per node), groups with
    nothing left out. Hierarchical: 2·4·r·L_max per bucket inside the node, the inner method on range j between."""
    if ccfg.method != "hierarchical":
        total = sum(flat_payload(ccfg.method, ccfg, s, sum(x.numel() for x in s), n) for s in buckets)
        return {"dp": total} if total else {}
    intra = inter = 0
    for shapes in buckets:
        ranges = row_ranges(shapes, per_node)
        if per_node > 1:
            intra += 2 * 4 * per_node * max(b - a for a, b in ranges)  # reduce-scatter input + all-gather output
        a, b = ranges[rank % per_node]
        inter += flat_payload(ccfg.inner, ccfg, piece_shapes(shapes, (a, b)), b - a, n // per_node)
    return {g: v for g, v in (("dp_intra", intra), ("dp_inter", inter)) if v}


def formula_ratio(method: str, buckets: list[list[torch.Size]], n: int) -> float:
    """Uncompressed all-reduce wire / the method's wire at dp=n from the payload formulas (a flat method)."""
    ccfg = compression_cfg(dict(BYTES_METHODS)[method])
    numel = sum(x.numel() for s in buckets for x in s)
    payload = formula_payload(ccfg, buckets, n, n, 0)["dp"]
    stats = sum(stats_payload(ccfg.method, ccfg, s) for s in buckets)  # an all-reduce beside the two-phase exchange
    wire = ((payload - stats) * (1 if method in TWO_PHASE else 2) + 2 * stats) * (n - 1) / n
    return 4 * numel * 2 * (n - 1) / n / wire
