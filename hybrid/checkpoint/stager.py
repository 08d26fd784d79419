"""The blocking part of an async save: a copy of the live state into CPU buffers kept across saves,
and the no-op stager DCP's `async_save` is handed for a state already copied. No collectives."""

from __future__ import annotations

from typing import Any

import torch


class Stager:
    """The blocking part of an async save: copy every tensor of the state into CPU buffers that are kept
    from one save to the next (one save is in flight at a time, so a buffer is free again when the next
    save stages). Reusing them is ~9× faster than the first save's fresh allocations (measured with
    gpt-125m at tp2pp2dp2: 0.22 s vs 2.06 s). A DTensor's local shard becomes a DTensor over its buffer.
    Every rank stages its whole state, DP replicas included (DCP drops duplicates only when it plans
    the write), so the buffers hold about 2× the checkpoint at dp=2."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return buf.copy_(t)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out: dict[str, Any] = {}
        for key, v in state.items():
            if isinstance(v, DTensor):
                out[key] = DTensor.from_local(self._buffer(key, v.to_local()), v.device_mesh, v.placements,
                                              run_check=False, shape=v.shape, stride=v.stride())
            elif isinstance(v, torch.Tensor):
                out[key] = self._buffer(key, v)
            else:
                out[key] = v  # bytes: immutable
        return out


class Staged:
    """DCP's async stager protocol for a state `Stager` has already copied: nothing left to do."""

    should_synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
