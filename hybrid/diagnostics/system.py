"""The facts of one rank and of its host, and their exchange over the world.

`rank_facts` is what one process sees (its device, the versions of torch, CUDA, NCCL and the driver, the
launcher's environment); `host_facts` is what the machine shows (CPU, memory, NUMA nodes from
`/sys/devices/system/node`, network interfaces from `/sys/class/net`, `nvidia-smi topo -m`). Every reader
tolerates a missing or unreadable file (`None` in the facts), so the same code runs on a laptop, in a
container and on a GPU node. `gather_facts` hands each rank's facts to every rank with one
`all_gather_object` over the default group (small picklable dicts, one per rank).
"""

from __future__ import annotations

import itertools
import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional, cast

import torch
import torch.distributed as dist

Facts = dict[str, object]
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
NODE_ROOT = Path("/sys/devices/system/node")
NET_ROOT = Path("/sys/class/net")
IB_ROOT = Path("/sys/class/infiniband")
SMI_TIMEOUT_S = 10.0


def read_text(path: Path) -> Optional[str]:
    """The stripped text of a small file, or None when it is missing or unreadable (sysfs raises
    OSError on reads such as a down interface's `speed`)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path) -> Optional[int]:
    """An integer file; None when missing, unreadable, not a number, or negative (sysfs's 'unknown')."""
    text = read_text(path)
    try:
        value = int(text) if text is not None else -1
    except ValueError:
        return None
    return value if value >= 0 else None


def numa_nodes(root: Path = NODE_ROOT) -> list[Facts]:
    """NUMA nodes and their CPU lists (`node0: cpus 0-15`); empty when sysfs shows none."""
    try:
        names = sorted((p.name for p in root.glob("node[0-9]*")), key=lambda n: int(n[4:]))
    except OSError:
        return []
    return [{"node": int(n[4:]), "cpus": read_text(root / n / "cpulist")} for n in names]


def nics(root: Path = NET_ROOT) -> list[Facts]:
    """Network interfaces: name, link speed in Mb/s and NUMA node (None where sysfs does not say)."""
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    return [{"name": n, "speed_mbps": read_int(root / n / "speed"), "state": read_text(root / n / "operstate"),
             "numa_node": read_int(root / n / "device" / "numa_node")} for n in names]


def ib_devices(root: Path = IB_ROOT) -> list[Facts]:
    """RDMA adapters: name, link layer of port 1 (InfiniBand, or Ethernet for RoCE) and its rate; [] without."""
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    return [{"name": n, "link_layer": read_text(root / n / "ports" / "1" / "link_layer"),
             "rate": read_text(root / n / "ports" / "1" / "rate")} for n in names]


def run_smi(args: list[str], timeout_s: float = SMI_TIMEOUT_S) -> Optional[str]:
    """`nvidia-smi <args>`'s output, or None when nvidia-smi is absent, fails or exceeds `timeout_s`."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    info = read_text(Path("/proc/cpuinfo")) or ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    return found.group(1).strip() if found else platform.processor() or platform.machine() or "unknown"


def memory_bytes() -> Optional[int]:
    """Total memory of the host (MemTotal of /proc/meminfo), None where it is not readable."""
    found = re.search(r"^MemTotal:\s*(\d+)\s*kB", read_text(Path("/proc/meminfo")) or "", re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def host_facts(smi_timeout_s: float = SMI_TIMEOUT_S) -> Facts:
    """What the machine shows: CPU model and cores, memory, NUMA nodes, NICs, RDMA adapters, `nvidia-smi topo -m`
    and the GPUs' PCI addresses in its order."""
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "memory_bytes": memory_bytes(), "numa": numa_nodes(), "nics": nics(),
            "ib_devices": ib_devices(), "topology": run_smi(["topo", "-m"], smi_timeout_s),
            "gpu_bus_ids": gpu_bus_ids(smi_timeout_s)}


def gpu_bus_ids(smi_timeout_s: float = SMI_TIMEOUT_S) -> list[str]:
    """The host's GPUs' PCI addresses in nvidia-smi's order (its `topo -m` names GPU<i> by it); [] without one."""
    out = run_smi(["--query-gpu=pci.bus_id", "--format=csv,noheader"], smi_timeout_s)
    return [line.strip() for line in (out or "").splitlines() if line.strip()]


def env_vars(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The launcher's and the libraries' settings: NCCL_*, GLOO_*, TORCH_*, and MASTER_ADDR/PORT,
    LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS."""
    env = dict(os.environ) if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def device_facts(device: torch.device) -> Facts:
    """The rank's device: the GPU's name, memory and compute capability, or the CPUs it may run on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "index": device.index, "name": props.name, "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}", "bus_id": _bus_id(props)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "cpu", "name": cpu_model(), "memory_bytes": memory_bytes(), "cores": cores,
            "threads": torch.get_num_threads()}


def _bus_id(props: object) -> Optional[str]:
    """The GPU's PCI address where this torch exposes it (`pci_bus_id` etc. vary between versions)."""
    parts = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return None if None in parts else "{:04x}:{:02x}:{:02x}".format(*parts)


def versions(device: torch.device, backend: str, smi_timeout_s: float = SMI_TIMEOUT_S) -> dict[str, Optional[str]]:
    """torch, python and the backend; with CUDA also CUDA, NCCL and the driver."""
    out: dict[str, Optional[str]] = {"torch": torch.__version__, "python": platform.python_version(),
                                     "backend": backend}
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        driver = run_smi(["--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index}"],
                         smi_timeout_s)
        out |= {"cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                "driver": driver.splitlines()[0].strip() if driver else None}
    return out


def rank_facts(device: torch.device, backend: str, with_host: bool,
               smi_timeout_s: float = SMI_TIMEOUT_S) -> Facts:
    """Everything one rank reports. `node_key` is its hostname and, under torchrun, its agent's
    GROUP_RANK: two agents on one host (emulated nodes) are two nodes, as the trainer sees them.
    `with_host` adds `host_facts` (one rank per agent collects them: the first local rank)."""
    host = socket.gethostname()
    agent = os.environ.get("GROUP_RANK")
    facts: Facts = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "local_rank": _env_int("LOCAL_RANK"), "hostname": host, "pid": os.getpid(),
        "node_key": host if agent is None else f"{host}#{agent}",
        "device": device_facts(device), "versions": versions(device, backend, smi_timeout_s), "env": env_vars(),
    }
    if with_host:
        facts["host"] = host_facts(smi_timeout_s)
    return facts


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def gather_facts(facts: Facts) -> list[Facts]:
    """Every rank's facts, by rank, on every rank: one `all_gather_object` over the default group
    (a pickled dict per rank; under NCCL it travels through the current CUDA device). A world of
    one needs no group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [facts]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, facts)
    return cast(list[Facts], out)


def node_size(keys: list[str]) -> Optional[int]:
    """The ranks per node that the ranks' node keys show, when every node is one run of the same number
    of consecutive ranks (the trainer's node = rank // ranks_per_node); None when they do not."""
    runs = [len(list(g)) for _, g in itertools.groupby(keys)]
    return runs[0] if len(set(runs)) == 1 and len(runs) == len(set(keys)) else None

