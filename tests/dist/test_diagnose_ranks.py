"""hybrid-diagnose on forked gloo ranks (an already initialised process group), and its one-line errors as the
forked ranks of a torchrun run. Transfers are tiny and no test reads this machine's timings: the slow
rank is made of made-up ping-pong times (the exchanges still run, their seconds are replaced), so the
verdict is the same on an idle and on a loaded machine. That a delay in an exchange reaches its time, and
where the slow-rank threshold lies, is unit-tested (tests/unit/test_diagnose.py).

The forked runs share one launch per world size (2 and 4 ranks: `launched`, once per module), each writing
into its own folder, with the configs the tool composes on every rank composed before the ranks fork."""

from __future__ import annotations

import functools
import io
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from hybrid.diagnostics import pairwise
from hybrid.diagnostics.pairwise import bandwidth_gbs
from hybrid.testing.cli_runs import run_forked_ranks
from hybrid.tools import diagnose

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--size", "64K", "--iters", "2", "--warmup", "1"]
SIZE = 64 * 1024
FAST_S, SLOW_S = 1e-4, 1e-2  # made-up seconds per ping-pong: the slow rank's links 100× slower
PNG = b"\x89PNG\r\n\x1a\n"


def tool(rank: int, world: int, argv: list[str]) -> dict:
    """Run the tool on this rank."""
    out = io.StringIO()
    code = diagnose.run(argv, out)
    return {"code": code, "text": out.getvalue(), "still_initialised": dist.is_initialized()}


def scripted(rank: int, world: int, argv: list[str], slow_rank: int) -> dict:
    """Run the tool with made-up ping-pong times: SLOW_S on each link of `slow_rank`, FAST_S on the others. The
    pairs still exchange their bytes; only the seconds the leader reports are replaced."""
    real = pairwise.time_pair

    def made_up(buf: torch.Tensor, peer: int, leader: bool, iters: int, warmup: int) -> list[float]:
        real(buf, peer, leader, iters, warmup)
        return [SLOW_S if slow_rank in (rank, peer) else FAST_S] * iters

    pairwise.time_pair = made_up  # this forked rank only, until the run is over
    try:
        return tool(rank, world, argv)
    finally:
        pairwise.time_pair = real


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def check_matrix(doc: dict, world: int) -> list[list[float]]:
    m = doc["bandwidth"]["matrix"]
    assert len(m) == world and all(len(row) == world for row in m)
    assert all(m[i][i] is None for i in range(world))
    assert all(m[i][j] > 0 and m[i][j] == m[j][i] for i in range(world) for j in range(world) if i != j)
    return m


def argvs(root: Path) -> dict[str, list[str]]:
    """Each run's command line, writing into its own folder under `root`."""
    return {"two": [*QUICK, "--json", str(root / "two" / "d.json"), "--png", str(root / "two" / "d.png")],
            "unfit": [*QUICK, "parallel=tp2pp2"],
            "nodes": [*QUICK, "parallel.ranks_per_node=2", "parallel=tp2", "--json", str(root / "nodes" / "d.json")],
            "slow": [*QUICK, "--json", str(root / "slow" / "d.json")]}


WORLDS = {"two": 2, "unfit": 2, "nodes": 4, "slow": 4}
SLOW_RANK = 3


def runs(rank: int, world: int, root: Path) -> dict[str, dict]:
    """Rank function: every run of this world size in turn (`slow`: rank SLOW_RANK's links made slow)."""
    out = {}
    for name, argv in argvs(root).items():
        if WORLDS[name] == world:
            out[name] = scripted(rank, world, argv, SLOW_RANK) if name == "slow" else tool(rank, world, argv)
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, dict[str, list[dict]]]]:
    """world → (the runs' root folder, run → its results by rank), each world launched once."""
    root = tmp_path_factory.mktemp("diagnose")
    for name in WORLDS:
        (root / name).mkdir()

    @functools.cache
    def launch(world: int) -> tuple[Path, dict[str, list[dict]]]:
        for argv in argvs(root).values():  # what `diagnose.compose` composes on every rank: once here
            diagnose.compose(diagnose.parse_args(argv).overrides)
        results = run_ranks(runs, world, root)
        return root, {name: [r[name] for r in results] for name in results[0]}

    return launch


def test_two_ranks_report_json_and_png(launched: Callable[[int], tuple[Path, dict[str, list[dict]]]]) -> None:
    root, by_run = launched(2)
    tmp_path, results = root / "two", by_run["two"]
    assert [r["code"] for r in results] == [0, 0] and all(r["still_initialised"] for r in results)
    assert "bandwidth (GB/s" in results[0]["text"] and results[1]["text"] == ""  # rank 0 reports
    doc = load(tmp_path / "d.json")
    m = check_matrix(doc, 2)
    assert doc["world"] == 2 and doc["backend"] == "gloo" and doc["nodes"]["count"] == 1
    assert doc["bandwidth"]["summary"]["intra"]["count"] == 1 and doc["bandwidth"]["summary"]["inter"] is None
    assert doc["bandwidth"]["summary"]["intra"]["median"] == m[0][1]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and len(doc["hosts"]) == 1
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG


def test_four_ranks_on_two_emulated_nodes(launched: Callable[[int], tuple[Path, dict[str, list[dict]]]]) -> None:
    root, by_run = launched(4)
    tmp_path, results = root / "nodes", by_run["nodes"]
    assert [r["code"] for r in results] == [0] * 4
    doc = load(tmp_path / "d.json")
    m = check_matrix(doc, 4)
    assert doc["nodes"] == {"count": 2, "ranks_per_node": 2, "source": "parallel.ranks_per_node=2",
                            "node_of": [0, 0, 1, 1], "hosts": doc["nodes"]["hosts"]}
    intra, inter = [m[0][1], m[2][3]], [m[0][2], m[0][3], m[1][2], m[1][3]]
    for name, links in (("intra", intra), ("inter", inter)):
        got = doc["bandwidth"]["summary"][name]
        want = {"min": min(links), "median": statistics.median(links), "max": max(links), "count": len(links)}
        assert got == want, name
    assert doc["layout"]["tp_groups"] == [[0, 1], [2, 3]] and doc["suggestion"]["options"][0]["tp"] == 2
    text = results[0]["text"]
    assert "2 node(s) × 2 ranks" in text and "intra-node: 2 links" in text and "inter-node: 4 links" in text


def test_a_slow_rank_shows_up_as_low_cells(launched: Callable[[int], tuple[Path, dict[str, list[dict]]]]) -> None:
    """Each link's time lands in its two cells on every rank (the pair schedule, the leader's write, the
    all-reduce), and a rank whose every link is slow is the one `slow_rank` warning of the report."""
    root, by_run = launched(4)
    assert [r["code"] for r in by_run["slow"]] == [0] * 4
    doc = load(root / "slow" / "d.json")
    m = check_matrix(doc, 4)
    fast, slow = bandwidth_gbs(SIZE, FAST_S), bandwidth_gbs(SIZE, SLOW_S)
    assert m == [[None if i == j else slow if SLOW_RANK in (i, j) else fast for j in range(4)] for i in range(4)]
    flagged = [w for w in doc["warnings"] if w["code"] == "slow_rank"]
    assert [w["ranks"] for w in flagged] == [[SLOW_RANK]]


def test_a_layout_that_does_not_fit_is_bad_input_on_every_rank(
        launched: Callable[[int], tuple[Path, dict[str, list[dict]]]]) -> None:
    results = launched(2)[1]["unfit"]
    assert [r["code"] for r in results] == [2, 2] and all(r["text"] == "" for r in results)


def test_a_bad_flag_is_one_line_per_rank() -> None:
    """The real entry point as the 2 ranks of a torchrun run (forked with torchrun's environment: the `[rankN]`
    prefix and the linger for the peers' lines use it; tests/e2e/test_torchrun.py runs the real torchrun)."""
    runs = run_forked_ranks(diagnose.main, ["--bogus"], ROOT, 2, {"OMP_NUM_THREADS": "1"})
    assert [r.code for r in runs] == [2, 2]
    ours = [ln for r in runs for ln in r.error_lines()]
    assert sorted(ln.split()[0] for ln in ours) == ["[rank0]", "[rank1]"]
    assert all("unknown option '--bogus'" in ln for ln in ours)
