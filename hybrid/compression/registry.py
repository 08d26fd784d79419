"""The compression methods' registry: method → factory(compression cfg, DP group) → (hook, state), and the check
of the `compression` config against it (`hooks.make_hook` wraps what a factory returns in `hooks.Compression`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybrid.compression import CompressionError, adaptive_rank, codecs, layout, powersgd, scaling, zeroone_adam
from hybrid.compression.defaults import check_warmup, density_of
from hybrid.compression.dgc import DGCState, dgc_hook
from hybrid.compression.onebit_adam import MomentumExchange, local_hook
from hybrid.compression.plain import CastState, allreduce_hook, cast_hook
from hybrid.compression.schedule import check_schedule
from hybrid.parallel.collectives import Group

if TYPE_CHECKING:
    from hybrid.config import CompressionConfig

Hook = Callable[[Any, Any], torch.futures.Future]


def _allreduce(cfg: CompressionConfig, group: Group) -> tuple[Hook, Any]:
    return allreduce_hook, group


def _cast(dtype: torch.dtype) -> Callable[[CompressionConfig, Group], tuple[Hook, Any]]:
    return lambda cfg, group: (cast_hook, CastState(group, dtype))


def _two_phase(name: str, spec: codecs.CodecSpec) -> Callable[[CompressionConfig, Group], tuple[Hook, Any]]:
    def make(cfg: CompressionConfig, group: Group) -> tuple[Hook, Any]:
        feedback = spec.error_feedback and cfg.error_feedback
        codec = spec.build(cfg)
        if scaling.scaled(cfg, name):
            return scaling.factored_hook, scaling.FactoredState(codec, group, feedback,
                                                                 columns=layout.by_columns(cfg, codec))
        return layout.two_phase_for(cfg, codec), codecs.TwoPhaseState(codec, group, feedback)
    return make


def _dgc(cfg: CompressionConfig, group: Group) -> tuple[Hook, Any]:
    fraction = density_of(cfg, None)  # `make_hook`'s resolved config: sized from the run
    return dgc_hook, DGCState(codecs.TopKCodec(fraction), group, True, fraction=fraction,
                              momentum=cfg.dgc_momentum, clip=cfg.dgc_clip, warmup_steps=cfg.sparsity_warmup_steps)


def _onebit_adam(cfg: CompressionConfig, group: Group) -> tuple[Hook, Any]:
    codec = codecs.SignCodec(cfg.block_size)
    return local_hook, MomentumExchange(codec, group, cfg.error_feedback, columns=layout.by_columns(cfg, codec),
                                        refresh=cfg.var_refresh_every)


REGISTRY: dict[str, Callable[[CompressionConfig, Group], tuple[Hook, Any]]] = {
    "none": _allreduce,
    "fp16": _cast(torch.float16),
    "bf16": _cast(torch.bfloat16),
    **{name: _two_phase(name, spec) for name, spec in codecs.CODECS.items()},  # int8, sign, topk
    "powersgd": powersgd.make,
    "dgc": _dgc,
}
"""Flat gradient methods: name → factory(compression cfg, group) → (hook, state); `make_hook` builds the others."""

OPTIMIZER_SIDE: dict[str, Callable[[CompressionConfig, Group], tuple[Hook, Any]]] = {
    "onebit_adam": _onebit_adam, "zeroone_adam": lambda cfg, group: zeroone_adam.make(cfg, group, allreduce_hook)}
"""Methods that compress inside the optimizer step (`optim.build_optimizer` picks the optimizer by the state)."""

METHODS = (*REGISTRY, "hierarchical", "torch_fp16", "torch_bf16", "torch_powersgd", *OPTIMIZER_SIDE)


def check(cfg: CompressionConfig) -> None:
    """Validate the `compression` config; one CompressionError line naming the bad knob."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise CompressionError(msg)

    need(cfg.method in METHODS, f"compression.method={cfg.method!r} is not one of {', '.join(METHODS)}")
    need(cfg.rank > 0, f"compression.rank must be > 0, got {cfg.rank}")
    need(cfg.fraction is None or 0 < cfg.fraction <= 1, f"compression.fraction must be in (0, 1] (null: sized from "
         f"the run), got {cfg.fraction}")
    need(cfg.block_size > 0, f"compression.block_size must be > 0, got {cfg.block_size}")
    need(cfg.block_layout in layout.LAYOUTS, f"compression.block_layout must be one of {', '.join(layout.LAYOUTS)}, "
         f"got {cfg.block_layout!r}")
    need(cfg.scale in scaling.SCALES, f"compression.scale must be one of {', '.join(scaling.SCALES)}, got "
         f"{cfg.scale!r}")
    need(cfg.scale != "factored" or bool({cfg.method, cfg.inner} & set(scaling.FACTORED)), "compression.scale="
         f"factored applies to the gradient's block codecs {', '.join(scaling.FACTORED)} (or hierarchical's inner "
         f"one of them), not compression={cfg.method}; auto or none")
    check_warmup(cfg)
    need(0 <= cfg.dgc_momentum < 1, f"compression.dgc_momentum must be in [0, 1), got {cfg.dgc_momentum}")
    need(cfg.dgc_clip >= 0, f"compression.dgc_clip must be >= 0 (0: no local clipping), got {cfg.dgc_clip}")
    need(cfg.sparsity_warmup_steps >= 0, f"compression.sparsity_warmup_steps must be >= 0, got "
         f"{cfg.sparsity_warmup_steps}")
    need(cfg.method != "dgc" or cfg.error_feedback, "compression=dgc accumulates what it did not send: it needs "
         "compression.error_feedback=true")
    check_schedule(cfg, [m for m in REGISTRY if m != "none"], list(OPTIMIZER_SIDE))
    zeroone_adam.check_knobs(cfg)
    need(cfg.var_refresh_every is None or cfg.var_refresh_every >= 0, "compression.var_refresh_every must be >= 0 "
         f"(0: 1-bit Adam's variance frozen, 0/1 Adam's refreshes the paper's; null: sized from optim.beta2), got "
         f"{cfg.var_refresh_every}")
    need(cfg.measure_every >= 1, f"compression.measure_every must be >= 1, got {cfg.measure_every}")
    need(cfg.min_compression_rate > 0, f"compression.min_compression_rate must be > 0, got {cfg.min_compression_rate}")
    adaptive_rank.check_knobs(cfg)
    need(cfg.factor_dtype in powersgd.FACTOR_DTYPES, "compression.factor_dtype must be one of "
         f"{', '.join(powersgd.FACTOR_DTYPES)} (what PowerSGD's factors travel in), got {cfg.factor_dtype!r}")
    if cfg.method == "hierarchical":
        need(cfg.inner in REGISTRY, f"compression=hierarchical needs compression.inner set to one of "
             f"{', '.join(REGISTRY)} (the method between nodes), got {cfg.inner!r}")
