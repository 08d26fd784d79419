"""`hybrid-diagnose --nccl`: the communication library's settings for the machines found, each with its reason.
Pure functions of the ranks' facts (hybrid.diagnostics.system: hosts' `topo -m`, NICs, InfiniBand devices, the
environment), so each rule is tested on crafted facts. docs/nccl.md says what every setting does, when it helps
and when it hurts; the advice is the part of that page that applies here.

An `Advice` is a setting and a value (empty: leave it unset), a verdict (`set`, `try` — measure the step with and
without it, `keep` — the default is right here, `unset` — the environment sets something that hurts on this
machine — or `debug`, for one run) and one line of reason naming what was found.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .topology import Topo, nearest_nic, parse, switched

NVLS_GPUS = ("H100", "H200", "H800", "H20", "GH200", "B200", "B100", "GB200")  # NVSwitch generations with SHARP
VIRTUAL_NICS = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "tun", "tap")


@dataclass(frozen=True)
class Advice:
    setting: str
    value: str
    verdict: str  # set | keep | unset | debug
    reason: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def advise(facts: list[dict[str, Any]], tp: int = 1, tp_overlap: str = "none") -> list[Advice]:
    """Every rule's advice for these ranks (rank 0's environment is the one judged) running a layout of `tp` with
    `parallel.tp_overlap`."""
    hosts = [f["host"] for f in facts if "host" in f]
    topos = [t for t in (parse(h.get("topology")) for h in hosts) if t is not None]
    env, multi = facts[0].get("env", {}), len({f["hostname"] for f in facts}) > 1
    gpus = [f["device"].get("name", "") for f in facts if f["device"].get("kind") == "cuda"]
    out = debug_advice() + p2p_advice(topos, env) + nvls_advice(topos, gpus, env)
    if multi:
        out += hca_advice(topos, hosts) + socket_advice(hosts) + roce_advice(hosts) + buffer_advice(hosts)
    if gpus and tp > 1 and tp_overlap != "none":
        out += channel_advice(tp, tp_overlap)
    return out + algo_advice(env)


def debug_advice() -> list[Advice]:
    return [Advice("NCCL_DEBUG", "INFO", "debug", "for one run: the version, transports and rings NCCL built "
                   "(WARN: problems only)"),
            Advice("NCCL_DEBUG_SUBSYS", "INIT,NET,GRAPH", "debug", "with NCCL_DEBUG=INFO: set-up, network, the "
                   "topology and the rings/trees chosen"),
            Advice("NCCL_DEBUG_FILE", "nccl.%h.%p.log", "debug", "one file per process instead of every rank "
                   "on the console")]


def p2p_advice(topos: list[Topo], env: dict[str, str]) -> list[Advice]:
    """NVLink: direct transfers must stay on; PCIe pairs through the CPU: try staging through host memory."""
    if any(any(c.startswith("NV") for c in t.codes.values()) for t in topos):
        if env.get("NCCL_P2P_DISABLE") == "1" or env.get("NCCL_P2P_LEVEL", "NVL") in ("LOC", "0"):
            return [Advice("NCCL_P2P_DISABLE / NCCL_P2P_LEVEL", "", "unset", "the GPUs are joined by NVLink: "
                           "without direct transfers every byte inside the node goes through host memory")]
        return [Advice("NCCL_P2P_LEVEL", "", "keep", "NVLink joins the GPUs: NCCL's default path is the fast one")]
    far = sorted({c for t in topos for (a, b), c in t.codes.items() if a.startswith("GPU") and b.startswith("GPU")
                  and c in ("PHB", "NODE", "SYS")})
    if not far:
        return [Advice("NCCL_P2P_LEVEL", "", "keep", "no GPU pair crosses the CPU" if topos else
                       "no GPU topology read (nvidia-smi absent)")]
    return [Advice("NCCL_P2P_LEVEL", "PXB", "set", f"PCIe-only GPUs with pairs through the CPU ({', '.join(far)}): "
                   "direct transfers there are often slower than staging through host memory; measure both "
                   "with hybrid-commbench")]


def nvls_advice(topos: list[Topo], gpus: list[str], env: dict[str, str]) -> list[Advice]:
    """NVLink SHARP on Hopper/Blackwell NVSwitch machines: NCCL's fastest all-reduce inside the node."""
    if not (any(switched(t) for t in topos) and any(g in name for name in gpus for g in NVLS_GPUS)):
        return []
    if env.get("NCCL_NVLS_ENABLE") == "0":
        return [Advice("NCCL_NVLS_ENABLE", "", "unset", "NVSwitch with NVLink SHARP: NVLS is the fastest "
                       "all-reduce inside the node; disable it only to free its buffers' memory")]
    return [Advice("NCCL_NVLS_ENABLE", "", "keep", "NVSwitch with NVLink SHARP: NCCL uses NVLS by itself")]


def hca_advice(topos: list[Topo], hosts: list[dict[str, Any]]) -> list[Advice]:
    """Keep the training traffic on the adapters next to the GPUs (the compute rails)."""
    ib = sorted({d["name"] for h in hosts for d in h.get("ib_devices") or []})
    near = sorted({n[0] for t in topos for g in t.gpus if (n := nearest_nic(t, g)) and n[1] in ("PIX", "PXB")})
    if not ib or not near or set(ib) <= set(near):
        return [Advice("NCCL_IB_HCA", "", "keep", "every InfiniBand adapter is next to a GPU" if ib else
                       "no InfiniBand adapter found: NCCL uses sockets between the nodes")]
    rest = ", ".join(sorted(set(ib) - set(near)))
    return [Advice("NCCL_IB_HCA", "=" + ",".join(near), "set", f"the adapters behind the GPUs' PCIe switches "
                   f"(a leading '=': exact names, so mlx5_1 does not also match mlx5_10); the others ({rest}) look "
                   "like storage or management rails")]


def socket_advice(hosts: list[dict[str, Any]]) -> list[Advice]:
    """Bootstrap (and, without InfiniBand, all traffic) on the fastest real interface, gloo's too."""
    up = {n["name"]: n.get("speed_mbps") or 0 for h in hosts for n in h.get("nics") or []
          if n.get("state") == "up" and not n["name"].startswith(VIRTUAL_NICS)}
    if len(up) < 2:
        return [Advice("NCCL_SOCKET_IFNAME", "", "keep", f"one usable interface ({next(iter(up), 'none')}): "
                       "nothing to choose")]
    best = max(sorted(up), key=lambda n: up[n])
    reason = f"{len(up)} interfaces are up ({', '.join(sorted(up))}): the fastest, {best}, for NCCL's bootstrap"
    return [Advice("NCCL_SOCKET_IFNAME", best, "set", reason),
            Advice("GLOO_SOCKET_IFNAME", best, "set", "the same for hybrid's gloo groups (parameter server, "
                   "checkpoint barriers) and CPU runs")]


def roce_advice(hosts: list[dict[str, Any]]) -> list[Advice]:
    """RoCE needs the GID of the RoCE v2 address; plain InfiniBand needs nothing; no RDMA: wider sockets."""
    devices = [d for h in hosts for d in h.get("ib_devices") or []]
    if not devices:
        return [Advice("NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD", "4 / 4", "set", "no RDMA adapter: NCCL "
                       "runs over TCP, and more sockets per peer fill a fast Ethernet link")]
    if any(d.get("link_layer") == "Ethernet" for d in devices):
        return [Advice("NCCL_IB_GID_INDEX", "3", "set", "RoCE adapters: the GID of the RoCE v2 address (check "
                       "with show_gids; a wrong index hangs at start-up)")]
    return []


def buffer_advice(hosts: list[dict[str, Any]]) -> list[Advice]:
    """Between nodes over TCP a larger buffer keeps more in flight; with RDMA the default is NCCL's tuned size."""
    if any(h.get("ib_devices") for h in hosts):
        return [Advice("NCCL_BUFFSIZE", "", "keep", "RDMA between the nodes: the default 4 MiB is NCCL's tuned size")]
    return [Advice("NCCL_BUFFSIZE", "8388608", "try", "NCCL over TCP between the nodes: a larger buffer keeps more "
                   "data in flight on a high-latency link; it costs GPU memory per channel and peer")]


def channel_advice(tp: int, tp_overlap: str) -> list[Advice]:
    """TP exchanges overlapped with GEMMs share the SMs with them: fewer NCCL channels leave more to the GEMMs."""
    return [Advice("NCCL_MAX_CTAS", "16", "try", f"tp={tp} with parallel.tp_overlap={tp_overlap}: the exchanges run "
                   "beside GEMMs, and each NCCL channel holds an SM; fewer leave more to the GEMMs but slow the "
                   "exchange (NCCL before 2.17: NCCL_MAX_NCHANNELS)")]


def algo_advice(env: dict[str, str]) -> list[Advice]:
    """NCCL's tuner picks the algorithm and protocol per size; forcing one is wrong for some sizes."""
    forced = [k for k in ("NCCL_ALGO", "NCCL_PROTO") if env.get(k)]
    if forced:
        return [Advice(" / ".join(forced), "", "unset", "forced for every size: small messages want LL and trees, "
                       "large ones Simple and rings; compare with hybrid-commbench at the run's sizes first")]
    return [Advice("NCCL_ALGO / NCCL_PROTO", "", "keep", "NCCL's tuner picks per size; to compare, run "
                   "hybrid-commbench with NCCL_ALGO=Ring and then Tree at the run's sizes")]


def render(advice: list[Advice]) -> str:
    """The section `hybrid-diagnose --nccl` prints."""
    lines = ["NCCL settings for what was found (docs/nccl.md: what each does, when it helps, when it hurts)"]
    for a in advice:
        what = f"{a.setting}={a.value}" if a.value else a.setting
        lines.append(f"  [{a.verdict}] {what}: {a.reason}")
    return "\n".join(lines)
