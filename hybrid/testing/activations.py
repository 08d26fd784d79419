"""What autograd saves for backward: `saved_tally(model)` counts the unique storages a forward saves, split
into the transformer layers and the ends (used by the TP activation benchmark and its test, and to check
the memory estimate); `tracked_peak(run)` the peak of the CPU memory `run` allocates."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def saved_tally(model: torch.nn.Module) -> Iterator[dict[int, tuple[str, int]]]:
    """{storage ptr: (region, nbytes)} of what the forward inside saves for backward, parameters and buffers
    (model state, e.g. rotary tables) left out.

    region: "layers" inside a transformer block (a module of `model.layers`), else "ends".
    """
    state = lambda: {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}  # noqa: E731
    seen: dict[int, tuple[str, int]] = {}
    region = ["ends"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()  # the parameters' storages now (ZeRO-3 gathers them into fresh storage)
        if not isinstance(t, torch.nn.Parameter) and ptr not in state() and ptr not in seen and storage.nbytes():
            seen[ptr] = (region[0], storage.nbytes())
        return t

    blocks = list(model.layers.values())
    handles = [b.register_forward_pre_hook(lambda *_: region.__setitem__(0, "layers")) for b in blocks]
    handles += [b.register_forward_hook(lambda *_: region.__setitem__(0, "ends")) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield seen
    finally:
        for h in handles:
            h.remove()


def tracked_peak(run: Callable[[], Any]) -> int:
    """The most bytes of CPU tensor memory allocated by `run()` and alive at once (the profiler's allocation
    records: every allocation and free while it runs, in order); what existed before is not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cpu = torch.autograd.DeviceType.CPU
    sizes = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()  # flat: a third of a tree walk
             if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak
