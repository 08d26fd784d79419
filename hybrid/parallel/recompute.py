"""Activation recomputation: keep a region's inputs, drop what its forward saved, rerun it in the backward.

`recompute(run, rngs, *args)` runs `run(*args)` without recording a graph and saves only its tensor
arguments (with `save_for_backward`, so a saved-tensor tally sees them). In the backward it reruns `run`
with the random state the forward had — the default CPU/CUDA generators *and* the TP streams `rngs`
(`hybrid.parallel.rng.TPRandom`), rewound to their state at the forward and moved back after — so a
dropout mask drawn in the recompute equals the one drawn in the forward, on every TP rank; then it
backpropagates through the rerun graph. Autocast is re-entered as it was. Collectives inside `run` (TP's
all-reduces of a whole block) run again in the backward and are counted again: that is full
recomputation's communication cost.

`act_linear(h, weight, act)` is `F.linear(act(h), weight)` saving `h` and not `act(h)`: the backward
recomputes the activation (elementwise, cheap) instead of keeping an ffn-wide tensor per layer — the MLP
half of selective recomputation (Korthikanti et al. 2022), without rerunning the matmul or a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hybrid.parallel.pp.split_backward import edges_of, needed
from hybrid.parallel.rng import TPRandom


@contextlib.contextmanager
def _replayed(states: Sequence[dict[str, torch.Tensor]], rngs: Sequence[TPRandom]) -> Iterator[None]:
    """The TP streams set to `states` inside, put back as they were after."""
    now = [r.state_dict() for r in rngs]
    for r, s in zip(rngs, states):
        r.load_state_dict(s)
    try:
        yield
    finally:
        for r, s in zip(rngs, now):
            r.load_state_dict(s)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., torch.Tensor], rngs: Sequence[TPRandom], *args: Any) -> torch.Tensor:
        ctx.run, ctx.rngs = run, rngs
        ctx.device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        ctx.autocast = _autocast_state(ctx.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
        ctx.tp_rng = [r.state_dict() for r in rngs]
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=ctx.device.type), _replayed(ctx.tp_rng, ctx.rngs):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                out = ctx.run(*args)
        torch.autograd.backward(out, grad)
        return (None, None, *(a.grad if isinstance(a, torch.Tensor) else None for a in args))


def recompute(run: Callable[..., torch.Tensor], rngs: Sequence[TPRandom], *args: Any) -> torch.Tensor:
    """`run(*args)` (one tensor out) whose activations are recomputed in the backward (see the module doc)."""
    return _Recompute.apply(run, rngs, *args)


class _ActLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        ctx.act = act
        ctx.autocast = _autocast_state(h.device.type)
        ctx.save_for_backward(h, weight)
        ctx.edges = edges_of(h, weight)
        return F.linear(act(h), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        h, weight = ctx.saved_tensors
        need_h, need_w = needed(ctx.needs_input_grad[:2], ctx.edges)  # a split backward's input or weight pass
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(h.device.type, dtype=dtype, enabled=enabled):
            x = h.detach().requires_grad_()
            a = ctx.act(x)
            w = weight.to(a.dtype)
            grad = grad.to(a.dtype)
            grad_a = grad @ w if need_h else None
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ a.detach().reshape(-1, a.shape[-1]) if need_w else None
        grad_h = torch.autograd.grad(a, x, grad_a)[0] if need_h else None
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None


def act_linear(h: torch.Tensor, weight: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`F.linear(act(h), weight)` keeping `h` for the backward instead of `act(h)` (see the module doc)."""
    return _ActLinear.apply(h, weight, act)
