"""What the planner knows of a machine: its accelerator (dense peak, memory, memory bandwidth, the efficiencies a
step reaches on it) and its links (inside a node, between nodes), from a preset, the command line or a
`hybrid-diagnose --json` report.

The GPU table's peaks are NVIDIA's data sheets (dense bf16 tensor core, no sparsity; `record.metrics`'s table).
Efficiencies are what large GEMMs and fused attention reach on the part in practice — the fraction of the peak
the planner divides FLOPs by — and the links' figures are all-reduce bus bandwidths as nccl-tests reports them on
such machines (per GPU; the inter-node one per GPU through its own NIC). They are the planner's assumptions, set
here once and shown with every plan; `--calibrate` measures the compute side on the machine at hand instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


class PlanError(ValueError):
    """A plan's input that cannot be planned for (an unknown GPU, a cluster no layout fits, bad sizes)."""


@dataclass(frozen=True)
class Device:
    """One accelerator: dense peak FLOP/s, memory bytes, memory bandwidth B/s, and the fractions of the peak its
    large GEMMs (`gemm`) and attention kernels (`attention`) reach; `launch_s`: a kernel's fixed cost."""

    name: str
    peak: float
    memory: int
    hbm: float
    gemm: float = 0.75
    attention: float = 0.45
    launch_s: float = 5e-6
    kind: str = "cuda"  # cuda | cpu: which kernels the memory estimate assumes
    cores: int = 0  # > 0: a node's ranks share this many cores (CPU ranks), each at `peak` while it runs alone
    optimizer_bw: float = 0.0  # B/s of the optimizer's pass (`cost.optimizer_s`) where calibrated; 0: `hbm`


@dataclass(frozen=True)
class Link:
    """A class of links: bus bandwidth in B/s (nccl-tests' busbw, per rank) and per-hop latency in seconds."""

    busbw: float
    latency: float


GiB = 2**30
DEVICES = {
    "a100-40gb": Device("A100 40GB", 312e12, 40 * GiB, 1.555e12),
    "a100-80gb": Device("A100 80GB", 312e12, 80 * GiB, 2.039e12),
    "h100": Device("H100 SXM", 989e12, 80 * GiB, 3.35e12, gemm=0.70, attention=0.40),
    "h200": Device("H200", 989e12, 141 * GiB, 4.8e12, gemm=0.70, attention=0.40),
}
CPU = Device("CPU core", 50e9, 0, 10e9, gemm=1.0, attention=0.5, kind="cpu")  # the ratios of a core, uncalibrated
LINKS = {  # all-reduce bus bandwidth per GPU as nccl-tests shows it, and a hop's latency
    "nvlink3": Link(230e9, 8e-6), "nvlink4": Link(450e9, 8e-6), "pcie4": Link(20e9, 10e-6),
    "ib-hdr": Link(22e9, 15e-6), "ib-ndr": Link(45e9, 15e-6), "eth-100g": Link(10e9, 30e-6),
    "gloo-local": Link(2e9, 50e-6),  # gloo between processes of one machine over local TCP (a CPU run's links)
}


@dataclass(frozen=True)
class Cluster:
    """`nodes` × `per_node` devices; `intra` the links inside a node, `inter` between nodes."""

    device: Device
    per_node: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def world(self) -> int:
        return self.per_node * self.nodes

    def describe(self) -> str:
        d = self.device
        peak = f"{d.peak / 1e12:.0f} TFLOP/s" if d.peak >= 1e12 else f"{d.peak / 1e9:.1f} GFLOP/s"
        return (f"{self.nodes} × {self.per_node} {d.name} ({peak} dense, {d.memory / GiB:.0f} GiB;"
                f" GEMMs at {d.gemm:.0%}, attention at {d.attention:.0%}), links {self.intra.busbw / 1e9:.3g} GB/s "
                f"inside a node, {self.inter.busbw / 1e9:.3g} GB/s between nodes")


CLUSTERS = {  # name → (device, devices per node, intra link, inter link)
    "dgx-a100": ("a100-80gb", 8, "nvlink3", "ib-hdr"),
    "dgx-a100-40gb": ("a100-40gb", 8, "nvlink3", "ib-hdr"),
    "dgx-h100": ("h100", 8, "nvlink4", "ib-ndr"),
    "hgx-h200": ("h200", 8, "nvlink4", "ib-ndr"),
}


def device(name: str) -> Device:
    if name not in DEVICES:
        raise PlanError(f"unknown GPU {name!r}; known: {', '.join(DEVICES)} (or --calibrate on the machine at hand)")
    return DEVICES[name]


def local_device(device_type: str) -> Device:
    """The device a run on `device_type` trains on, as the table knows it (its name matched against the GPU's);
    an unknown GPU is taken for an H100: only the ratios of its op classes matter to a stage balance."""
    if device_type != "cuda":
        return CPU
    import torch

    name = torch.cuda.get_device_name().lower()
    return next((d for key, d in DEVICES.items() if key.split("-")[0] in name), DEVICES["h100"])


def link(name: str) -> Link:
    if name not in LINKS:
        raise PlanError(f"unknown link {name!r}; known: {', '.join(LINKS)} (or GB/s as a number)")
    return LINKS[name]


def link_of(text: str) -> Link:
    """A link by name, or a bus bandwidth in GB/s (latency: 10 µs)."""
    try:
        gbps = float(text)
    except ValueError:
        return link(text)
    if not gbps > 0:
        raise PlanError(f"a link's bandwidth must be > 0 GB/s, got {text}")
    return Link(gbps * 1e9, 10e-6)


def preset(name: str, nodes: int) -> Cluster:
    """The cluster `name` (`CLUSTERS`) with `nodes` nodes."""
    if name not in CLUSTERS:
        raise PlanError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}")
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    gpu, per_node, intra, inter = CLUSTERS[name]
    return Cluster(device(gpu), per_node, nodes, link(intra), link(inter))


def from_diagnose(path: Path, base: Cluster) -> Cluster:
    """`base` with its node size and links from a `hybrid-diagnose --json` report: the median ping-pong bandwidth
    of the pairs inside a node and across nodes (GB/s; a ring's bus bandwidth per rank is its slowest hop's)."""
    try:
        report = json.loads(Path(path).read_text())
        summary, per_node = report["bandwidth"]["summary"], int(report["nodes"]["ranks_per_node"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"{path} is not a hybrid-diagnose --json report ({e})") from None
    intra, inter = (summary.get(k) or {} for k in ("intra", "inter"))
    return replace(base, per_node=per_node, intra=_measured(intra, base.intra), inter=_measured(inter, base.inter))


def _measured(stats: dict, fallback: Link) -> Link:
    median = stats.get("median")
    return Link(float(median) * 1e9, fallback.latency) if median else fallback
