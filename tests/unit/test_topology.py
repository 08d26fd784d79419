"""`nvidia-smi topo -m` classified (hybrid.diagnostics.topology) on outputs written after NVIDIA's documentation of
real machines (tests/unit/topo/): a DGX H100 (NVSwitch, 2 sockets, a ConnectX-7 behind each GPU's PCIe switch),
a DGX A100 (NVSwitch, 2 AMD sockets in NPS4: 8 NUMA nodes), and two PCIe-only servers (2 sockets; 1 socket); then
pairs of ranks from their facts (network, shared memory, same device, by PCI address)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid.diagnostics.topology import bus_key, gpu_class, gpu_lines, nearest_nic, pair_classes, parse, switched

TOPO = Path(__file__).parent / "topo"


def topo(name: str):  # noqa: ANN201
    t = parse((TOPO / f"{name}.txt").read_text())
    assert t is not None
    return t


def test_dgx_h100_is_nvswitch_with_a_nic_behind_each_gpu() -> None:
    t = topo("dgx_h100")
    assert t.gpus == [f"GPU{i}" for i in range(8)] and len(t.nics) == 10 and switched(t)
    assert {gpu_class(t, "GPU0", f"GPU{j}") for j in range(1, 8)} == {"nvswitch"}
    assert [nearest_nic(t, f"GPU{i}") for i in (0, 5)] == [("mlx5_0", "PIX"), ("mlx5_5", "PIX")]
    assert (t.cpus["GPU0"], t.numa["GPU0"], t.cpus["GPU7"], t.numa["GPU7"]) == ("0-55,112-167", 0, "56-111,168-223", 1)
    assert gpu_lines(t)[0] == "GPU0: numa 0, cpus 0-55,112-167, nearest NIC mlx5_0 (pcie-switch)"
    assert gpu_lines(t)[-1] == "GPU pairs: nvswitch 28"


def test_dgx_a100_numa_nodes_per_gpu_pair() -> None:
    t = topo("dgx_a100")
    assert switched(t) and [t.numa[f"GPU{i}"] for i in range(8)] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert nearest_nic(t, "GPU2") == ("mlx5_2", "PXB")  # the first NIC behind the pair's switch
    assert t.cpus["GPU4"] == "112-127,240-255"


@pytest.mark.parametrize("name, pairs", [
    ("pcie_2socket", {("GPU0", "GPU1"): "pcie-switch", ("GPU0", "GPU2"): "cross-socket",
                      ("GPU2", "GPU3"): "pcie-switch"}),
    ("pcie_1socket", {("GPU0", "GPU1"): "pcie-bridges", ("GPU1", "GPU2"): "pcie-host-bridge"})])
def test_pcie_only_boxes(name: str, pairs: dict[tuple[str, str], str]) -> None:
    t = topo(name)
    assert not switched(t)
    assert {p: gpu_class(t, *p) for p in pairs} == pairs


def test_nics_and_their_absence() -> None:
    two = topo("pcie_2socket")
    assert nearest_nic(two, "GPU1") == ("eth0", "NODE") and nearest_nic(two, "GPU3") == ("eth0", "SYS")
    one = topo("pcie_1socket")
    assert nearest_nic(one, "GPU0") is None and gpu_lines(one)[0].endswith("nearest NIC none")


def test_nvlink_without_switches_and_what_is_not_a_matrix() -> None:
    bridge = parse("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-7\t0\nGPU1\tNV4\t X \t0-7\t0\n")
    assert bridge is not None and not switched(bridge) and gpu_class(bridge, "GPU0", "GPU1") == "nvlink"
    bold = parse("\x1b[4mGPU0\tGPU1\x1b[0m\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n")  # a terminal's bold header
    assert bold is not None and gpu_class(bold, "GPU0", "GPU1") == "cross-socket"
    assert parse(None) is None and parse("No devices were found") is None


def test_bus_addresses_of_nvidia_smi_and_torch_agree() -> None:
    assert bus_key("00000000:1B:00.0") == bus_key("0000:1b:00") == (0, 0x1B, 0)
    assert bus_key("") is None and bus_key(None) is None


def _rank(host: str, kind: str = "cuda", index: int = 0, bus: str | None = None) -> dict:
    return {"hostname": host, "device": {"kind": kind, "index": index, "bus_id": bus}}


def test_pairs_of_ranks() -> None:
    text = (TOPO / "pcie_2socket.txt").read_text()
    buses = ["00000000:1B:00.0", "00000000:3D:00.0", "00000000:9A:00.0", "00000000:BC:00.0"]
    a = {**_rank("a", index=0, bus="0000:9a:00"), "host": {"topology": text, "gpu_bus_ids": buses}}
    facts = [a, _rank("a", index=1, bus="0000:bc:00"), _rank("a", index=0, bus="0000:9a:00"), _rank("b"),
             _rank("c", "cpu"), _rank("c", "cpu")]
    classes = pair_classes(facts)
    assert classes[(0, 1)] == "pcie-switch"  # GPU2 and GPU3 by PCI address, whatever CUDA's indices say
    assert classes[(0, 2)] == "same-device" and classes[(0, 3)] == "network" and classes[(4, 5)] == "shared-memory"
