"""hybrid-diagnose without processes: the pair schedule, the advice on crafted matrices and layouts (each
warning fires on a layout made to trigger it and not on a good one), the node assignment, this machine's
facts, the heat map, the report and the command line's bad input."""

from __future__ import annotations

import io
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch

from hybrid.diagnostics import advice as A
from hybrid.diagnostics import heatmap, pairwise, system
from hybrid.diagnostics.pairwise import bandwidth_gbs, rounds, summarize
from hybrid.diagnostics.report import Probe, Report, render, size_text, spans
from hybrid.parallel.context import Layout
from hybrid.tools import diagnose

FAST, SLOW = 10.0, 1.0
PNG = b"\x89PNG\r\n\x1a\n"


def crafted(world: int, fast_sets: list[set[int]], fast: float = FAST, slow: float = SLOW) -> list[list[float]]:
    """A symmetric matrix: `fast` between two ranks of one set of `fast_sets`, `slow` elsewhere, NaN diagonal."""
    def bw(i: int, j: int) -> float:
        return math.nan if i == j else fast if any({i, j} <= s for s in fast_sets) else slow
    return [[bw(i, j) for j in range(world)] for i in range(world)]


def codes(found: list[A.Finding]) -> list[str]:
    return [f.code for f in found]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_rounds_meet_every_pair_once_with_each_rank_in_at_most_one_pair_per_round(world: int) -> None:
    sched = rounds(world)
    assert len(sched) == (world - 1 if world % 2 == 0 else world)
    for pairs in sched:
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks))
    met = sorted(p for pairs in sched for p in pairs)
    assert met == list(itertools.combinations(range(world), 2))
    assert sorted(p for [p] in rounds(world, serial=True)) == met


def test_bandwidth_is_one_way_bytes_per_second_of_a_ping_pong() -> None:
    # 1e9 bytes there and back in 2 s: 1 GB/s each way
    assert bandwidth_gbs(10**9, 2.0) == pytest.approx(1.0)


def test_a_delay_in_an_exchange_is_in_its_time_and_lowers_its_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    """`time_pair` times each exchange after untimed warm-ups: an exchange that sleeps DELAY seconds takes at least
    that (a lower bound, whatever else runs on the machine), so its link's cell is at most size there and back in
    DELAY."""
    delay, calls = 0.02, []

    def sleepy(buf: torch.Tensor, peer: int, leader: bool) -> None:
        calls.append((peer, leader))
        time.sleep(delay)

    monkeypatch.setattr(pairwise, "exchange", sleepy)
    times = pairwise.time_pair(torch.zeros(8, dtype=torch.uint8), 1, True, iters=2, warmup=1)
    assert calls == [(1, True)] * 3 and len(times) == 2 and min(times) >= delay
    assert bandwidth_gbs(8, statistics.median(times)) <= bandwidth_gbs(8, delay)


def test_summary_splits_links_by_node() -> None:
    m = crafted(4, [{0, 1}, {2, 3}])
    s = summarize(m, [0, 0, 1, 1])
    assert s["intra"] == {"min": FAST, "median": FAST, "max": FAST, "count": 2}
    assert s["inter"] == {"min": SLOW, "median": SLOW, "max": SLOW, "count": 4}
    assert summarize(m, [0, 0, 0, 0])["inter"] is None


def test_tp_across_nodes_warns_on_a_crafted_layout_and_not_on_a_good_one() -> None:
    m = crafted(4, [{0, 1}, {2, 3}])
    with pytest.warns(UserWarning):
        crossing = Layout.create(4, tp=4, ranks_per_node=2, allow_tp_across_nodes=True)
    found = A.tp_findings(crossing, m)
    assert codes(found) == ["tp_across_nodes", "tp_slow_link"]
    assert found[0].ranks == (0, 1, 2, 3) and "inter-node median 1 GB/s" in found[0].message
    assert A.tp_findings(Layout.create(4, tp=2, ranks_per_node=2), m) == []


def test_cp_across_nodes_is_a_finding_of_its_own() -> None:
    m = crafted(4, [{0, 1}, {2, 3}])
    with pytest.warns(UserWarning):
        crossing = Layout.create(4, tp=2, cp=2, ranks_per_node=2, allow_cp_across_nodes=True)
    found = A.findings(crossing, m, "none")
    assert "cp_across_nodes" in codes(found) and "tp_across_nodes" not in codes(found)
    cp = next(f for f in found if f.code == "cp_across_nodes")
    assert cp.ranks == (0, 1, 2, 3) and "CP K/V exchange" in cp.message


def test_a_tp_group_on_a_slow_link_inside_a_node_warns() -> None:
    m = crafted(4, [{0, 2}, {1, 3}])  # the fast pairs are not consecutive ranks
    found = A.tp_findings(Layout.create(4, tp=2, ranks_per_node=4), m)
    assert codes(found) == ["tp_slow_link"] and found[0].ranks == (0, 1, 2, 3)


def test_slow_inter_node_without_compression_warns_and_compression_silences_it() -> None:
    m = crafted(4, [{0, 1}, {2, 3}])
    dp_across = Layout.create(4, ranks_per_node=2)  # dp=4 over 2 nodes
    found = A.inter_node_findings(dp_across, m, "none")
    assert codes(found) == ["slow_inter_node"] and "compression=hierarchical-powersgd" in found[0].message
    assert A.inter_node_findings(dp_across, m, "powersgd") == []
    assert A.inter_node_findings(dp_across, m, "hierarchical") == []
    assert A.inter_node_findings(Layout.create(4, tp=2, pp=2, ranks_per_node=2), m, "none") == []  # dp=1
    assert A.inter_node_findings(dp_across, crafted(4, [{0, 1}, {2, 3}], slow=FAST / 3), "none") == []  # 1/3 >= 1/4


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_slow_inter_node_under_zero_advises_hybrid_sharding_or_zero_plus_plus(zero: int) -> None:
    """ZeRO refuses PowerSGD: across slow nodes the advice is HSDP or ZeRO++ (hpZ and qwZ only under ZeRO-3);
    HSDP already keeps the shards inside a node: nothing to advise."""
    m, dp_across = crafted(4, [{0, 1}, {2, 3}]), Layout.create(4, ranks_per_node=2)
    found = A.findings(dp_across, m, "none", zero=zero)
    assert codes(found) == ["slow_inter_node"], found
    message = found[0].message
    assert "parallel.zero_group=node" in message and "compression=int4" in message and "powersgd" not in message
    assert ("parallel.zero_hpz=true" in message) == (zero == 3)
    assert A.findings(dp_across, m, "none", zero=zero, zero_group="node") == []


@pytest.mark.parametrize("overrides, cut", [([], "none"), (["compression=powersgd"], "powersgd"),
                                            (["sync=diloco"], "sync=diloco"), (["sync=ps"], "sync=ps")])
def test_what_cuts_the_dp_bytes_is_named_by_the_sync_owner(overrides: list[str], cut: str) -> None:
    """The advice's "exact gradient sync" test reads `hybrid.sync.bytes_cut_by`: a slow-link mode counts too."""
    from hybrid.config import compose_config
    from hybrid.sync import bytes_cut_by

    assert bytes_cut_by(compose_config(overrides)) == cut


def test_a_slow_rank_is_flagged() -> None:
    m = crafted(4, [{0, 1, 2}])  # every link of rank 3 is slow
    layout = Layout.create(4)
    found = A.slow_rank_findings(layout, m)
    assert codes(found) == ["slow_rank"] and found[0].ranks == (3,)
    assert A.slow_rank_findings(layout, crafted(4, [{0, 1, 2, 3}])) == []


def test_a_slow_rank_of_four_needs_links_below_a_third_of_the_others() -> None:
    """Rank 3's three links are half of a world of four's six, so the median lies halfway between its links (s)
    and the others' (f): it is flagged when s < 0.5 · (s + f) / 2, that is when s < f / 3."""
    layout = Layout.create(4)
    assert [f.ranks for f in A.slow_rank_findings(layout, crafted(4, [{0, 1, 2}], fast=3.0, slow=0.99))] == [(3,)]
    assert A.slow_rank_findings(layout, crafted(4, [{0, 1, 2}], fast=3.0, slow=1.01)) == []


def test_suggestion_keeps_tp_inside_the_fast_clique() -> None:
    s = A.suggest(Layout.create(4, ranks_per_node=4), crafted(4, [{0, 1}, {2, 3}]))
    assert (s.tp, s.links_tp, s.islands, s.consecutive) == (2, 2, [[0, 1], [2, 3]], True)
    assert [(o.tp, o.fast, o.worst_gbs) for o in s.options] == [(2, True, FAST), (4, False, SLOW)]


def test_suggestion_when_the_fast_pairs_are_not_consecutive() -> None:
    s = A.suggest(Layout.create(4, ranks_per_node=4), crafted(4, [{0, 2}, {1, 3}]))
    assert (s.tp, s.islands, s.consecutive) == (1, [[0, 2], [1, 3]], False)


def test_suggestion_on_uniform_links_with_emulated_nodes() -> None:
    s = A.suggest(Layout.create(4, ranks_per_node=2), crafted(4, [{0, 1, 2, 3}]))
    assert (s.tp, s.ranks_per_node, s.links_tp) == (2, 2, 4)  # the node size caps tp; the links would allow 4


def test_nodes_from_hosts() -> None:
    assert system.node_size(["a", "a", "b", "b"]) == 2
    assert system.node_size(["a", "a", "a"]) == 3
    assert system.node_size(["a", "b", "a", "b"]) is None and system.node_size(["a", "a", "b"]) is None
    hosts = ["a", "a", "b", "b"]
    found = A.node_findings(Layout.create(4, ranks_per_node=4), hosts)
    assert codes(found) == ["node_spans_hosts"] and found[0].ranks == (0, 1, 2, 3)
    assert A.node_findings(Layout.create(4, ranks_per_node=2), hosts) == []
    assert A.node_findings(Layout.create(4, ranks_per_node=1), hosts) == []  # emulated nodes inside a host


def test_versions_that_differ_are_flagged() -> None:
    same = {"torch": "2.5", "python": "3.11"}
    found = A.version_findings([same, same, {**same, "torch": "2.4"}])
    assert codes(found) == ["versions_differ"] and found[0].ranks == (2,)
    assert A.version_findings([same, same]) == []


def test_this_machines_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system.shutil, "which", lambda name: None)  # as without nvidia-smi
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    facts = system.rank_facts(torch.device("cpu"), "gloo", with_host=True)
    assert {"rank", "local_rank", "hostname", "node_key", "device", "versions", "env", "host"} <= facts.keys()
    assert facts["device"]["kind"] == "cpu" and facts["device"]["cores"] >= 1
    assert facts["versions"] == {"torch": torch.__version__, "python": facts["versions"]["python"], "backend": "gloo"}
    assert facts["env"]["NCCL_DEBUG"] == "INFO"
    host = facts["host"]
    assert {"hostname", "cpu", "cores", "memory_bytes", "numa", "nics", "topology"} <= host.keys()
    assert host["topology"] is None
    json.dumps(facts)  # the facts travel as JSON


def test_sysfs_readers_tolerate_missing_and_unreadable_files(tmp_path: Path) -> None:
    node, net = tmp_path / "node", tmp_path / "net"
    (node / "node1").mkdir(parents=True)
    (node / "node1" / "cpulist").write_text("8-15\n")
    (node / "node0").mkdir()  # no cpulist
    assert system.numa_nodes(node) == [{"node": 0, "cpus": None}, {"node": 1, "cpus": "8-15"}]
    (net / "eth0" / "device").mkdir(parents=True)
    (net / "eth0" / "speed").write_text("25000\n")
    (net / "eth0" / "device" / "numa_node").write_text("1\n")
    (net / "ib0" / "speed").mkdir(parents=True)  # reading it raises, like a down link's speed
    (net / "lo").mkdir()
    (net / "lo" / "speed").write_text("-1\n")
    got = {n["name"]: (n["speed_mbps"], n["numa_node"]) for n in system.nics(net)}
    assert got == {"eth0": (25000, 1), "ib0": (None, None), "lo": (None, None)}
    assert system.numa_nodes(tmp_path / "missing") == [] and system.nics(tmp_path / "missing") == []


def test_env_vars_keep_the_launchers_and_libraries_settings() -> None:
    env = {"NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISTRIBUTED_DEBUG": "INFO",
           "MASTER_PORT": "29500", "HOME": "/root", "PATH": "/bin"}
    assert list(system.env_vars(env)) == ["GLOO_SOCKET_IFNAME", "MASTER_PORT", "NCCL_IB_HCA", "TORCH_DISTRIBUTED_DEBUG"]


def test_heatmap_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "m.png"
    heatmap.write_heatmap(crafted(4, [{0, 1}, {2, 3}]), str(path), "bandwidth", "GB/s", node_of=[0, 0, 1, 1])
    assert path.read_bytes()[:8] == PNG
    heatmap.write_heatmap([[0.0, 3e6], [1e6, 0.0]], str(path), "bytes per step", "bytes")  # generic units
    assert path.read_bytes()[:8] == PNG
    assert heatmap.node_boundaries([0, 0, 1, 1, 2]) == [2, 4]


def fake_report(layout: Layout, matrix: list[list[float]], method: str) -> Report:
    facts = system.rank_facts(torch.device("cpu"), "gloo", with_host=True)
    per_rank = [{**facts, "rank": r} for r in range(layout.world)]
    return Report(per_rank, layout, "hosts", matrix, Probe(4 << 20, 5, 1, False), method,
                  A.findings(layout, matrix, method), A.suggest(layout, matrix))


def test_report_renders_every_section_and_matches_its_json() -> None:
    rep = fake_report(Layout.create(4, ranks_per_node=2), crafted(4, [{0, 1}, {2, 3}]), "none")
    text = render(rep)
    for needle in ("world 4, backend gloo", "ranks", "versions (every rank)", "environment", "host ",
                   "bandwidth (GB/s", "intra-node: 2 links", "inter-node: 4 links", "layout: world=4",
                   "warnings (1)", "[slow_inter_node]", "suggestion", "→ parallel.tp=2"):
        assert needle in text, needle
    doc = json.loads(json.dumps(rep.to_json(), allow_nan=False))
    assert doc["nodes"]["count"] == 2 and doc["nodes"]["node_of"] == [0, 0, 1, 1]
    assert doc["bandwidth"]["matrix"][0] == [None, FAST, SLOW, SLOW]
    assert [w["code"] for w in doc["warnings"]] == ["slow_inter_node"] and doc["suggestion"]["tp"] == 2


def test_size_and_spans_text() -> None:
    assert (size_text(4 << 20), size_text(65536), size_text(1000)) == ("4 MiB", "64 KiB", "1000 B")
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("text,n", [("4M", 4 << 20), ("64KiB", 65536), ("1000", 1000), ("2 MB", 2 * 10**6)])
def test_sizes(text: str, n: int) -> None:
    assert diagnose.parse_size(text) == n


@pytest.mark.parametrize("argv,needle", [
    (["--bogus"], "unknown option '--bogus'"), (["--size", "12Q"], "--size must be a byte count"),
    (["--size=0"], "--size must be between"), (["--iters", "0"], "--iters must be an integer >= 1"),
    (["--timeout", "-1"], "--timeout must be a number > 0"), (["--timeout=inf"], "--timeout must be a number"),
    (["--json"], "--json needs a value"), (["--png", "--strict"], "--png needs a value"),
    (["--strict=1"], "--strict takes no value"), (["tp2"], "expected an option or a key=value override"),
])
def test_bad_command_lines(argv: list[str], needle: str) -> None:
    with pytest.raises(diagnose.UsageError, match=needle):
        diagnose.parse_args(argv)


def test_options_and_overrides() -> None:
    opts = diagnose.parse_args(["parallel=tp2", "--size", "1K", "--iters=3", "--serial", "--json", "a.json",
                                "compression=powersgd"])
    assert (opts.size, opts.iters, opts.serial, opts.json) == (1024, 3, True, "a.json")
    assert opts.overrides == ["parallel=tp2", "compression=powersgd"]


def test_one_process_bad_input_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert diagnose.run(["--bogus"]) == 2
    assert diagnose.run(["parallel=tp2pp2"]) == 2  # tp·pp = 4 does not divide a world of 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("hybrid: error: unknown option")
    assert err[1] == "hybrid: error: parallel.tp·parallel.pp = 2·2 = 4 does not divide world size 1"


def test_one_process_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert diagnose.run(["--json", str(tmp_path / "d.json")]) == 0
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["world"] == 1 and doc["bandwidth"]["matrix"] == [[None]] and doc["suggestion"] is None
    assert doc["nccl"] is None and doc["bandwidth"]["by_class"] == {}
    out = capsys.readouterr().out
    assert "a world of 1 has no links to measure" in out and "NCCL settings" not in out
    assert diagnose.run(["--nccl", "--json", str(tmp_path / "n.json")]) == 0
    advice = {a["setting"]: a["verdict"] for a in json.loads((tmp_path / "n.json").read_text())["nccl"]}
    assert advice["NCCL_DEBUG"] == "debug" and "NCCL settings for what was found" in capsys.readouterr().out


def test_a_config_the_trainer_refuses_is_a_warning_and_strict_fails_on_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RANK", raising=False)
    argv = ["train.global_batch_size=7", "--json", str(tmp_path / "d.json")]  # not a multiple of micro_batch_size
    assert diagnose.run(argv, io.StringIO()) == 0
    [warning] = load_json(tmp_path / "d.json")["warnings"]
    assert warning["code"] == "config_refused" and "train.global_batch_size=7" in warning["message"]
    assert diagnose.run([*argv, "--strict"], io.StringIO()) == 1


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())
