"""hybrid-commbench's process group and `--backend`: gloo, NCCL, or both side by side on the same sizes.

Without `--backend` the default is NCCL where CUDA is present and gloo elsewhere, as in a training run. `gloo`
measures gloo on CPU tensors even on a GPU machine; `nccl` needs CUDA; `gloo,nccl` makes one process group with
both (`cpu:gloo,cuda:nccl`, as hybrid.train does), measures every table once on CPU tensors (gloo) and once on
the GPU (NCCL), and prints their bus bandwidths side by side (`compare`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.cli import UsageError, env_int
from hybrid.diagnostics import bandwidth as bw
from hybrid.diagnostics.report import size_text

BACKENDS = ("gloo", "nccl")


def parse_backends(text: Optional[str], cuda: bool) -> list[str]:
    """`--backend`'s comma list ([] without one: the default, see `process_group`); UsageError for an unknown
    one or NCCL without a GPU."""
    if text is None:
        return []
    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names or any(n not in BACKENDS for n in names) or len(set(names)) < len(names):
        raise UsageError(f"--backend must be gloo, nccl or gloo,nccl, got {text!r}")
    if "nccl" in names and not cuda:
        raise UsageError("--backend nccl needs a CUDA GPU, and none is visible here (use --backend gloo)")
    return names


@contextlib.contextmanager
def process_group(timeout_s: float, backends: Sequence[str]) -> Iterator[list[torch.device]]:
    """The devices to measure on, one per backend, inside a process group: the one already initialised (kept; by
    default its own backend's device), or one made here (torchrun's env://, or a world of one in memory without
    torchrun; by default NCCL with CUDA, else gloo) and destroyed on the way out."""
    if dist.is_initialized():
        yield [_device(b == "nccl") for b in backends or [dist.get_backend()]]
        return
    backends = list(backends) or ["nccl" if torch.cuda.is_available() else "gloo"]
    devices = [_device(b == "nccl") for b in backends]
    spec = "cpu:gloo,cuda:nccl" if len(backends) > 1 else backends[0]
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(spec, timeout=timeout)
    else:
        dist.init_process_group(spec, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    finished = False
    try:
        yield devices
        finished = True
    finally:
        if finished:  # the clean gloo exit (as hybrid.train): collect, barrier, destroy
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def _device(cuda: bool) -> torch.device:
    if not cuda:
        return torch.device("cpu")
    torch.cuda.set_device(env_int("LOCAL_RANK", 0))
    return torch.device("cuda", env_int("LOCAL_RANK", 0))


def compare(first: Sequence[bw.Table], second: Sequence[bw.Table], names: Sequence[str]) -> str:
    """The out-of-place bus bandwidth of the same tables under two backends, and their ratio."""
    a, b = names
    lines = ["#", f"# ===== {a} against {b}: bus bandwidth (GB/s, out of place) on the same sizes",
             f"#  group      op                size {a:>10} {b:>10}  {b}/{a}"]
    for ta, tb in zip(first, second):
        for ra, rb in zip(ta.rows, tb.rows):
            x, y = ra.out_of_place.busbw, rb.out_of_place.busbw
            lines.append(f"   {ta.groups.kind:<10} {ta.op:<14} {size_text(ra.size):>8} {x:>10.3f} {y:>10.3f}  "
                         + (f"{y / x:.2f}×" if x > 0 else "-"))
    return "\n".join(lines)
