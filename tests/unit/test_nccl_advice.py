"""`hybrid-diagnose --nccl` (hybrid.diagnostics.nccl_advice) on crafted ranks' facts with the `nvidia-smi topo -m`
outputs of tests/unit/topo/: each rule's advice and its reason, and the section the report prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybrid.diagnostics.nccl_advice import advise, render

TOPO = Path(__file__).parent / "topo"
DEBUG = ["NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"]


def host(name: str, topo: str | None, ib: list[tuple[str, str]] = (), nics: tuple[str, ...] = ("eth0",)
         ) -> dict[str, Any]:
    return {"hostname": name, "topology": (TOPO / f"{topo}.txt").read_text() if topo else None,
            "ib_devices": [{"name": n, "link_layer": layer, "rate": "400 Gb/sec"} for n, layer in ib],
            "nics": [{"name": n, "state": "up", "speed_mbps": 100000 if n.startswith("ib") else 25000}
                     for n in (*nics, "lo", "docker0")]}


def ranks(*hosts: dict[str, Any], gpu: str = "NVIDIA H100 80GB HBM3", env: dict[str, str] | None = None
          ) -> list[dict[str, Any]]:
    kind = "cuda" if gpu else "cpu"
    return [{"hostname": h["hostname"], "host": h, "env": env or {}, "device": {"kind": kind, "name": gpu}}
            for h in hosts]


def by_setting(facts: list[dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    return {a.setting: (a.value, a.verdict, a.reason) for a in advise(facts)}


IB = [(f"mlx5_{i}", "InfiniBand") for i in range(10)]


def test_two_dgx_h100_keep_the_defaults_but_name_the_compute_rails() -> None:
    got = by_setting(ranks(host("a", "dgx_h100", IB, ("eth0", "ib0")), host("b", "dgx_h100", IB, ("eth0", "ib0"))))
    assert list(got)[:3] == DEBUG and all(got[k][1] == "debug" for k in DEBUG)
    assert got["NCCL_P2P_LEVEL"][1] == "keep" and got["NCCL_NVLS_ENABLE"][1] == "keep"
    value, verdict, reason = got["NCCL_IB_HCA"]
    assert verdict == "set" and value == "=" + ",".join(f"mlx5_{i}" for i in range(8))
    assert "the others (mlx5_8, mlx5_9)" in reason
    assert got["NCCL_SOCKET_IFNAME"][:2] == ("ib0", "set") and got["GLOO_SOCKET_IFNAME"][:2] == ("ib0", "set")
    assert "NCCL_IB_GID_INDEX" not in got  # InfiniBand, not RoCE
    assert got["NCCL_BUFFSIZE"][1] == "keep" and got["NCCL_ALGO / NCCL_PROTO"][1] == "keep"
    assert "NCCL_MAX_CTAS" not in got  # tp=1


def test_what_the_environment_sets_that_hurts_here() -> None:
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_PROTO": "LL"}
    got = by_setting(ranks(host("a", "dgx_h100"), env=env))
    assert got["NCCL_P2P_DISABLE / NCCL_P2P_LEVEL"][1] == "unset" and got["NCCL_NVLS_ENABLE"][1] == "unset"
    assert got["NCCL_PROTO"][1] == "unset" and "forced for every size" in got["NCCL_PROTO"][2]
    assert "NCCL_IB_HCA" not in got and "NCCL_BUFFSIZE" not in got  # one host: no network advice


def test_overlapped_tp_may_want_fewer_channels() -> None:
    facts = ranks(host("a", "dgx_h100"))
    assert by_setting(facts) == {a.setting: (a.value, a.verdict, a.reason) for a in advise(facts, 1, "bulk")}
    got = {a.setting: a for a in advise(facts, 8, "chunked")}
    assert (got["NCCL_MAX_CTAS"].value, got["NCCL_MAX_CTAS"].verdict) == ("16", "try")
    assert "tp=8 with parallel.tp_overlap=chunked" in got["NCCL_MAX_CTAS"].reason
    assert "NCCL_MAX_CTAS" not in {a.setting for a in advise(facts, 8, "none")}
    assert "NCCL_MAX_CTAS" not in {a.setting for a in advise(ranks(host("a", None), gpu=""), 8, "bulk")}  # CPU


def test_pcie_boxes_try_host_staging_and_a100_has_no_nvls() -> None:
    pcie = by_setting(ranks(host("a", "pcie_2socket"), gpu="NVIDIA L40S"))
    assert pcie["NCCL_P2P_LEVEL"][:2] == ("PXB", "set") and "(SYS)" in pcie["NCCL_P2P_LEVEL"][2]
    assert "NCCL_NVLS_ENABLE" not in pcie
    a100 = by_setting(ranks(host("a", "dgx_a100"), gpu="NVIDIA A100-SXM4-80GB"))
    assert a100["NCCL_P2P_LEVEL"][1] == "keep" and "NCCL_NVLS_ENABLE" not in a100


def test_between_nodes_without_infiniband_and_with_roce() -> None:
    tcp = by_setting(ranks(host("a", None), host("b", None), gpu=""))
    assert tcp["NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD"][:2] == ("4 / 4", "set")
    assert tcp["NCCL_SOCKET_IFNAME"][1] == "keep"  # eth0 alone (lo, docker0 are not candidates)
    assert tcp["NCCL_IB_HCA"][1] == "keep" and tcp["NCCL_P2P_LEVEL"][1] == "keep"
    assert tcp["NCCL_BUFFSIZE"][:2] == ("8388608", "try")
    roce = [(f"mlx5_{i}", "Ethernet") for i in range(8)]
    got = by_setting(ranks(host("a", "dgx_h100", roce), host("b", "dgx_h100", roce)))
    assert got["NCCL_IB_GID_INDEX"][:2] == ("3", "set") and got["NCCL_IB_HCA"][1] == "keep"


def test_the_printed_section() -> None:
    text = render(advise(ranks(host("a", "pcie_2socket"), gpu="NVIDIA L40S")))
    lines = text.splitlines()
    assert lines[0].startswith("NCCL settings for what was found (docs/nccl.md")
    assert "  [debug] NCCL_DEBUG=INFO: for one run" in text and any(li.startswith("  [set] NCCL_P2P_LEVEL=PXB: ")
                                                                     for li in lines)
