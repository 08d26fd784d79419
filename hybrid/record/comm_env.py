"""The communication library a run ran with, in its record (`train.log`'s start-up lines, `summary.json`'s
`communication`): the backend, NCCL's version where the run uses it, and every variable of the environment that
changes how the ranks communicate — NCCL's own (`NCCL_*`), torch's around it (`TORCH_NCCL_*`), gloo's
(`GLOO_*`, `TORCH_GLOO_*`) and torch's debug switch — so that two runs' communication figures are compared
knowing what differed between them (docs/nccl.md says what each setting does). Rank 0's environment: launchers
give every rank the same one. And where the ranks run: the CPU binding the launch script chose (`binding_line`,
printed under the rank map).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_GLOO_", "TORCH_DISTRIBUTED_DEBUG")


def settings(env: Mapping[str, str]) -> dict[str, str]:
    """The communication settings among `env`, by name."""
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIXES)}


def nccl_version() -> Optional[str]:
    """The NCCL this torch loads ('2.21.5'); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def backend() -> str:
    """The default process group's backend ('gloo', 'nccl', 'cpu:gloo,cuda:nccl'); 'none' in one process."""
    return dist.get_backend() if dist.is_initialized() else "none"


def communication(name: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The record of a run over backend `name`: {backend, nccl (its version, or None), settings}."""
    return {"backend": name, "nccl": nccl_version() if "nccl" in name else None, "settings": settings(env)}


def line(doc: dict[str, Any]) -> str:
    """'communication: nccl 2.21.5; NCCL_IB_HCA=mlx5_0 NCCL_SOCKET_IFNAME=ib0' — the start-up line."""
    head = f"{doc['backend']} {doc['nccl']}" if doc["nccl"] else doc["backend"]
    pairs = " ".join(f"{k}={v}" for k, v in doc["settings"].items())
    return f"communication: {head}; {pairs or 'no NCCL_*, TORCH_NCCL_* or GLOO_* settings in the environment'}"


def binding_line(environ: Optional[dict[str, str]] = None) -> str:
    """The binding the launch script chose (HYBRID_BINDING, launch/binding.sh) and the CPUs this rank may run on."""
    env = dict(os.environ) if environ is None else environ
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    chosen = env.get("HYBRID_BINDING", "not set (the launch scripts in launch/ choose one)")
    return f"binding: {chosen}; rank 0 may run on CPUs {spans(cpus) or '?'} ({len(cpus)} of {os.cpu_count()})"


def spans(numbers: list[int]) -> str:
    """Sorted numbers (ranks, CPUs) as runs, a cpulist: [0, 1, 2, 5] → '0-2,5'; '' for none."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
