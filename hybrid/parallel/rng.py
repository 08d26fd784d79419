"""Dropout randomness under tensor parallelism (Megatron's RNG tracker, for CPU and CUDA).

Two streams per rank:

- the default generator, seeded with `train.seed` on every rank, drives dropout on
  *replicated* activations (the residual stream without sequence parallelism): every TP rank
  holds the same tensor, so every TP rank must drop the same elements, and it does because
  the ranks make the same draws in the same order;
- a TP stream, seeded from (seed, TP rank, first layer of the stage), drives dropout on
  activations that differ between TP ranks: attention probabilities of this rank's heads,
  and, under sequence parallelism, this rank's chunk of the sequence. Each rank must draw its
  own mask there, or the same mask would repeat on every head group / sequence chunk.

`fork()` swaps the TP stream into the default generator of the device for the duration of
a block and swaps it back, so library code that draws from the default generator
(`F.dropout`, `scaled_dot_product_attention`) uses it without being told.

Under context parallelism a CP rank's tokens are not its peers': both streams are made its own
(`stage_seed` with the CP rank, `ContextParallel.stream_seed`), or every chunk of a sequence would get the
same mask.

Dropout masks are not layout-independent (tp=2 draws different masks than tp=1); losses
equal the single-process run only at `model.dropout=0`.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (stable across processes and runs)."""
    text = ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def stage_seed(seed: int, pp_rank: int, cp_rank: int = 0, *more: object) -> int:
    """The default generator's seed on a rank (the stream of dropout on replicated activations): one per pipeline
    stage, and under context parallelism one per CP rank besides rank 0 (its tokens are not its peers'); the same
    on the TP and DP ranks of the stage. `more`: further parts (a resume's step)."""
    return derive_seed(seed, "stage", pp_rank, *(("cp", cp_rank) if cp_rank else ()), *more)


def _default_generator(device: torch.device) -> tuple[str, torch.Generator]:
    """(a stable key, the default generator) of `device`."""
    if device.type == "cuda":
        torch.cuda.init()  # the per-device generators exist only once CUDA is initialised
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}", torch.cuda.default_generators[index]
    return "cpu", torch.default_generator


class TPRandom:
    """The per-TP-rank dropout stream, kept per device and swapped in by `fork`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.states: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        key, gen = _default_generator(device)
        outside = gen.get_state()
        if key in self.states:
            gen.set_state(self.states[key])
        else:
            gen.manual_seed(self.seed)
        try:
            yield
        finally:
            self.states[key] = gen.get_state()
            gen.set_state(outside)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.states = dict(state)
