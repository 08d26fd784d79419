"""Links named, not only measured: `nvidia-smi topo -m` parsed, and every pair of ranks given the class of the
link between them, from the fastest:

- `nvswitch`: NVLink through NVSwitches — every pair of the host's (three or more) GPUs joined by the same number
  of NVLinks (`NV18` on a DGX H100, `NV12` on an A100 HGX); `topo -m` does not name the switches, the uniform
  full mesh is their signature;
- `nvlink`: NVLinks joining this pair directly (`NV#`, in a partial mesh or a 2-GPU bridge);
- `pcie-switch` (PIX: at most one PCIe bridge), `pcie-bridges` (PXB: several bridges, no host bridge),
  `pcie-host-bridge` (PHB: through the CPU's host bridge), `numa-node` (NODE: across host bridges inside one
  NUMA node), `cross-socket` (SYS: across the SMP interconnect between NUMA nodes, QPI/UPI/Infinity Fabric);
- `network`: ranks on different hosts; `shared-memory`: CPU ranks on one host (gloo over loopback);
  `same-device`: two ranks on one GPU; `same-host`: GPUs of one host whose `topo -m` could not be read.

Each GPU's row also gives its CPU and NUMA affinity, and the NIC nearest to it (the best PCIe class among the
NICs' columns; `NIC Legend` names them): what the launch scripts bind a rank to (docs/nccl.md) and what NCCL picks
by itself. Pure functions of the text and the ranks' facts (hybrid.diagnostics.system), tested on real outputs.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

PCIE = {"PIX": "pcie-switch", "PXB": "pcie-bridges", "PHB": "pcie-host-bridge", "NODE": "numa-node",
        "SYS": "cross-socket"}
ORDER = ("same-device", "nvswitch", "nvlink", "pcie-switch", "pcie-bridges", "pcie-host-bridge", "numa-node",
         "cross-socket", "same-host", "shared-memory", "network")  # fastest first


@dataclass(frozen=True)
class Topo:
    """One host's `nvidia-smi topo -m`: the codes between devices ("GPU0", "NIC1"), and per GPU its affinities."""

    devices: list[str]
    codes: dict[tuple[str, str], str]
    cpus: dict[str, str] = field(default_factory=dict)  # GPU → "0-55,112-167"
    numa: dict[str, Optional[int]] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)  # NIC0 → mlx5_0

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if d.startswith("NIC")]


def parse(text: Optional[str]) -> Optional[Topo]:
    """`nvidia-smi topo -m`'s text as a Topo; None when there is no GPU matrix in it."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "")  # the bold header a terminal gets
    rows = [_cells(line) for line in text.splitlines()]
    head = next((i for i, r in enumerate(rows) if r and r[0].startswith("GPU0")), None)
    if head is None:
        return None
    devices = [c for c in rows[head] if re.fullmatch(r"(GPU|NIC)\d+", c)]
    body = [r for r in rows[head + 1:] if r and r[0] in devices]
    codes = {(r[0], d): r[1 + j] for r in body for j, d in enumerate(devices) if 1 + j < len(r)}
    extra = {r[0]: r[1 + len(devices):] for r in body if r[0].startswith("GPU")}
    return Topo(devices, codes, {g: e[0] for g, e in extra.items() if e}, {g: _int(e[1:2]) for g, e in extra.items()},
                dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", text, re.MULTILINE)))


def _cells(line: str) -> list[str]:
    """A matrix line's cells: tab-separated in nvidia-smi's output, runs of spaces in copies of it."""
    return [c.strip() for c in re.split(r"\t+|\s{2,}", line.strip()) if c.strip()]


def _int(cells: Sequence[str]) -> Optional[int]:
    return int(cells[0]) if cells and cells[0].isdigit() else None


def gpu_class(topo: Topo, a: str, b: str) -> str:
    """The class of the link between GPUs `a` and `b` of one host."""
    if a == b:
        return "same-device"
    code = topo.codes.get((a, b), "")
    if code.startswith("NV"):
        return "nvswitch" if switched(topo) else "nvlink"
    return PCIE.get(code, "same-host")


def switched(topo: Topo) -> bool:
    """Every pair of three or more GPUs joined by the same number of NVLinks: NVSwitches between them."""
    gpus = topo.gpus
    seen = {topo.codes.get((a, b), "") for a in gpus for b in gpus if a != b}
    return len(gpus) >= 3 and len(seen) == 1 and next(iter(seen)).startswith("NV")


def nearest_nic(topo: Topo, gpu: str) -> Optional[tuple[str, str]]:
    """The NIC closest to `gpu` (its name from the NIC legend, else NICn) and the code between them."""
    if not topo.nics:
        return None
    nic = min(topo.nics, key=lambda n: _distance(topo.codes.get((gpu, n), "")))
    return topo.nic_names.get(nic, nic), topo.codes.get((gpu, nic), "?")


def _distance(code: str) -> int:
    """PIX 0 … SYS 4; anything else after them."""
    return list(PCIE).index(code) if code in PCIE else len(PCIE)


def gpu_lines(topo: Topo) -> list[str]:
    """Per GPU: its NUMA node, CPUs and nearest NIC; then the GPU pairs counted by class."""
    lines = []
    for g in topo.gpus:
        nic = nearest_nic(topo, g)
        lines.append(f"{g}: numa {_q(topo.numa.get(g))}, cpus {topo.cpus.get(g, '?')}, nearest NIC "
                     + (f"{nic[0]} ({PCIE.get(nic[1], nic[1])})" if nic else "none"))
    pairs = [gpu_class(topo, a, b) for i, a in enumerate(topo.gpus) for b in topo.gpus[i + 1:]]
    counts = ", ".join(f"{c} {pairs.count(c)}" for c in ORDER if c in pairs)
    return [*lines, f"GPU pairs: {counts or 'none'}"]


def _q(v: Optional[int]) -> str:
    return "?" if v is None else str(v)


def bus_key(bus_id: Optional[str]) -> Optional[tuple[int, int, int]]:
    """A PCI address as (domain, bus, device), from nvidia-smi's `00000000:1B:00.0` or torch's `0000:1b:00`."""
    found = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.\d)?", (bus_id or "").strip())
    return None if found is None else tuple(int(x, 16) for x in found.groups())  # type: ignore[return-value]


def smi_gpu(facts: dict[str, Any], host: dict[str, Any]) -> Optional[str]:
    """The rank's GPU as `topo -m` names it: by PCI address among the host's GPUs, else by its CUDA index."""
    dev = facts["device"]
    if dev.get("kind") != "cuda":
        return None
    keys = [bus_key(b) for b in host.get("gpu_bus_ids") or []]
    mine = bus_key(dev.get("bus_id"))
    return f"GPU{keys.index(mine)}" if mine is not None and mine in keys else f"GPU{dev.get('index')}"


def pair_classes(facts: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """The class of every pair of ranks (i < j), from their facts and their hosts' `topo -m`."""
    hosts = {f["hostname"]: f["host"] for f in facts if "host" in f}
    topos = {name: parse(h.get("topology")) for name, h in hosts.items()}
    return {(i, j): rank_pair_class(facts[i], facts[j], hosts, topos)
            for i in range(len(facts)) for j in range(i + 1, len(facts))}


def rank_pair_class(a: dict[str, Any], b: dict[str, Any], hosts: dict[str, Any], topos: dict[str, Any]) -> str:
    if a["hostname"] != b["hostname"]:
        return "network"
    if a["device"].get("kind") != "cuda":
        return "shared-memory"
    host, topo = hosts.get(a["hostname"], {}), topos.get(a["hostname"])
    ga, gb = smi_gpu(a, host), smi_gpu(b, host)
    if ga == gb:
        return "same-device"
    return gpu_class(topo, ga, gb) if topo is not None else "same-host"


def by_class(matrix: Sequence[Sequence[float]], classes: dict[tuple[int, int], str]) -> dict[str, dict[str, float]]:
    """The measured bandwidth (GB/s, both directions of each pair) summarised per link class, fastest class first."""
    seen: dict[str, list[float]] = {}
    for (i, j), name in classes.items():
        seen.setdefault(name, []).extend(v for v in (matrix[i][j], matrix[j][i]) if not math.isnan(v))
    return {name: {"links": len(seen[name]), "min": min(seen[name]), "median": statistics.median(seen[name]),
                   "max": max(seen[name])} for name in ORDER if seen.get(name)}
