"""hybrid-commbench on forked gloo ranks (its bad input as the forked ranks of a torchrun run).

References: every op's result against the one computed locally from the ranks' known inputs (the
tool's own check, made to fail by corrupting one element inside torch.distributed.all_reduce); the
groups against the trainer's (`Layout` and `ParallelContext.build` for the same layout); the preflight's
verdict against made-up GEMM and link seconds (its all-reduces, GEMMs and links still run; only the seconds
each rank reports are replaced), so a slow rank is flagged and a healthy world passes whatever else runs on
the machine. That a slow GEMM reaches its time is unit-tested (tests/unit/test_commbench.py).

The forked checks run in one launch per world size (2, 3 and 4 ranks, once per session: `launched`); a check
that replaces a function on its rank puts it back before the next one runs, and the layout's config is composed
before the ranks fork.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import run_ranks

from hybrid.comm_watch import read_preflight
from hybrid.config import compose_config
from hybrid.diagnostics import bandwidth as bw
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.testing.cli_runs import run_forked_ranks
from hybrid.tools import commbench

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"]


def _cells(t: bw.Table) -> list[bw.Cell]:
    return [c for r in t.rows for c in (r.out_of_place, r.in_place) if c is not None]


def every_op_rank(rank: int, world: int) -> dict[str, Any]:
    block, bw.CHECK_BLOCK = bw.CHECK_BLOCK, 100  # this forked rank only: results compared in several blocks
    try:
        out = commbench.execute(["-o", "all", *SMALL])
        low = commbench.execute(["-o", "all_reduce,reduce_scatter,broadcast", "-d", "bfloat16", *SMALL])
        odd = commbench.execute(["-o", "all_gather,all_to_all", "-d", "int8", *SMALL])
    finally:
        bw.CHECK_BLOCK = block
    tables = out.tables + low.tables + odd.tables
    return {"codes": [out.code, low.code, odd.code], "text": out.text,
            "tables": [(t.op, t.dtype, [(r.size, r.count, r.in_place is not None) for r in t.rows],
                        [c.wrong for c in _cells(t)]) for t in tables]}


def test_every_op_on_two_ranks_has_no_wrong_element() -> None:
    results = launched(2)["every_op"]
    assert [r["codes"] for r in results] == [[0, 0, 0]] * 2
    first = results[0]
    assert [t[0] for t in first["tables"][:6]] == list(bw.OPS)
    for op, dtype, rows, wrong in first["tables"]:
        assert wrong and all(w == 0 for w in wrong), (op, dtype, wrong)  # checked (not None) and right
        elem = torch.empty(0, dtype=bw.DTYPES[dtype]).element_size()
        assert all(size == count * elem for size, count, _ in rows)
        assert all(count % 2 == 0 for _, count, _ in rows) or op not in bw.CHUNKED
        assert all(in_place == (op not in bw.NO_IN_PLACE) for *_, in_place in rows)
    assert first["text"].count("# Avg bus bandwidth") == 6 and "out-of-place" in first["text"]


def corrupted_rank(rank: int, world: int) -> dict[str, Any]:
    real = dist.all_reduce

    def corrupt(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real(t, *args, **kwargs)
        if rank == 1 and t.numel() > 1:  # not the one-element barrier
            t.view(-1)[0] += 100
        return work

    dist.all_reduce = corrupt  # this forked rank only, until the check is over
    try:
        argv = ["-o", "all_reduce,all_gather", "-b", "64", "-e", "256", "-f", "4", "-n", "1", "-w", "0"]
        outcome = commbench.execute(argv)
        return {"code": outcome.code, "status": commbench.run(argv), "text": outcome.text,
                "wrong": {t.op: [c.wrong for c in _cells(t)] for t in outcome.tables}}
    finally:
        dist.all_reduce = real


def test_the_check_catches_a_corrupted_element_and_the_status_says_so() -> None:
    results = launched(2)["corrupted"]
    assert [(r["code"], r["status"]) for r in results] == [(1, 1)] * 2
    # sizes 64 B and 256 B, out of place and in place: one corrupted element on rank 1 in each checked call
    assert results[0]["wrong"] == {"all_reduce": [1, 1, 1, 1], "all_gather": [0, 0, 0, 0]}
    assert "# FAILED: 4 wrong element(s)" in results[0]["text"]


LAYOUT = ["parallel.tp=2", "parallel.ranks_per_node=2"]


def groups_rank(rank: int, world: int) -> dict[str, Any]:
    argv = [*LAYOUT, "--groups", "world,tp,dp,pp,dp_intra,dp_inter", "-o", "all_reduce", "-b", "8", "-e", "64",
            "-f", "8", "-n", "1", "-w", "0"]  # 8 B: fewer elements than the world has ranks
    outcome = commbench.execute(argv)
    trainer = ParallelContext.build(Layout.create(world, tp=2, ranks_per_node=2))
    theirs = {k: dist.get_process_group_ranks(getattr(trainer, f"{k}_group")) for k in ("tp", "dp", "pp")}
    return {"code": outcome.code, "text": outcome.text, "trainer": theirs,
            "used": {t.groups.kind: (t.groups.mine(), t.groups.ranks) for t in outcome.tables}}


def test_layout_groups_are_the_trainers_groups() -> None:
    layout = Layout.create(4, tp=2, ranks_per_node=2)
    expected = {"world": [[0, 1, 2, 3]], "tp": layout.tp_groups(), "dp": layout.dp_groups()}
    assert expected["tp"] == [[0, 1], [2, 3]] and expected["dp"] == [[0, 2], [1, 3]]  # the layout is not trivial
    results = launched(4)["groups"]
    for rank, r in enumerate(results):
        assert r["code"] == 0
        assert sorted(r["used"]) == ["dp", "tp", "world"]  # pp and dp_intra: 1 rank; dp_inter: the dp groups
        for kind, (mine, every) in r["used"].items():
            assert [list(g) for g in every] == expected[kind]
            assert rank in mine and list(mine) in expected[kind]
            if kind != "world":
                assert list(mine) == r["trainer"][kind]
    text = results[0]["text"]
    assert "# pp: groups of 1 rank" in text and "# dp_inter: the same groups as dp" in text
    assert "# ===== tp: 2 group(s) of 2 ranks: [0, 1] [2, 3]" in text


def preflight_rank(rank: int, world: int, gemm_s: list[float], link_s: list[float], *save: str) -> dict[str, Any]:
    """The preflight at its default threshold (20 %), this rank reporting the made-up `gemm_s[rank]` and
    `link_s[rank]` seconds for its GEMM and its outgoing link; `save`: `--save FILE`."""
    pf = commbench.pf
    real_gemm, real_link = pf.gemm_seconds, pf.link_seconds

    def gemm(plan: pf.Plan, device: torch.device) -> float:
        real_gemm(plan, device)
        return gemm_s[rank]

    def link(plan: pf.Plan, device: torch.device) -> float:
        real_link(plan, device)
        return link_s[rank]

    pf.gemm_seconds, pf.link_seconds = gemm, link  # this forked rank only, until the check is over
    try:
        outcome = commbench.execute(["--preflight", *save])
    finally:
        pf.gemm_seconds, pf.link_seconds = real_gemm, real_link
    report = outcome.preflight
    return {"code": outcome.code, "text": outcome.text, "problems": report.problems,
            "gemm_flags": pf.over_median(report.gemm, report.threshold)}


def rows(text: str) -> list[list[str]]:
    """The per-rank rows of the preflight table, split into cells."""
    return [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]


SLOW = ([1e-3, 1e-2, 1e-3], [2e-3] * 3)  # GEMM and link seconds by rank: rank 1's GEMM is slow
HEALTHY = ([1.0e-3, 1.1e-3, 1.2e-3], [2.0e-3, 2.1e-3, 2.2e-3])  # within 20 % of their medians
SAVED = Path(tempfile.mkdtemp(prefix="preflight")) / "pf.json"  # the healthy preflight's --save (the ranks inherit it)


SOAK = ["--soak", "0.3", "-e", "4K", "-o", "all_reduce,send_recv"]


def soak_rank(rank: int, world: int) -> dict[str, Any]:
    """A short soak over the layout's groups, then one whose all-reduce raises in its third round (every rank: a
    timed-out collective) and one with an all-reduce corrupted on rank 1."""
    healthy = commbench.execute([*LAYOUT, *SOAK])
    real_call, calls = bw.call, []

    def failing(op: str, *args: Any) -> None:
        calls.append(op)
        # all-reduces: round 1 times and checks tp's and dp's (4 calls), round 2 times them (6): the 8th is round 3's dp
        if op == "all_reduce" and calls.count("all_reduce") == 8:
            raise RuntimeError("Timed out waiting 300000ms for recv operation to complete\nmore detail")
        real_call(op, *args)

    bw.call = failing  # this forked rank only
    try:
        broken = commbench.execute([*LAYOUT, *SOAK, "--soak", "30"])
    finally:
        bw.call = real_call
    return {"healthy": (healthy.code, healthy.text), "broken": (broken.code, broken.text)}


def soak_corrupted_rank(rank: int, world: int) -> tuple[int, str]:
    real = dist.all_reduce

    def corrupt(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real(t, *args, **kwargs)
        if rank == 1 and t.numel() > 1:
            t.view(-1)[0] += 100
        return work

    dist.all_reduce = corrupt
    try:
        outcome = commbench.execute([*SOAK, "--backend", "gloo"])
    finally:
        dist.all_reduce = real
    return outcome.code, outcome.text


def run_jobs(rank: int, world: int) -> dict[str, Any]:
    """Rank function: every check of this world size in turn → its result by name."""
    if world == 2:
        return {"every_op": every_op_rank(rank, world), "corrupted": corrupted_rank(rank, world),
                "soak_corrupted": soak_corrupted_rank(rank, world)}
    if world == 3:
        return {"slow": preflight_rank(rank, world, *SLOW),
                "healthy": preflight_rank(rank, world, *HEALTHY, "--save", str(SAVED))}
    return {"groups": groups_rank(rank, world), "soak": soak_rank(rank, world)}


def soak_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The soak table's rows by (group, op), split into cells (the size, `4 KiB`, one cell)."""
    rows = (line.split() for line in text.splitlines() if line.startswith("   "))
    return {(r[0], r[1]): [*r[:2], f"{r[2]} {r[3]}", *r[4:]] for r in rows}


def test_a_soak_counts_every_call_of_every_group_and_op() -> None:
    code, text = launched(4)["soak"][0]["healthy"]
    assert code == 0, text
    head, *_ = text.splitlines()
    rounds = int(head.split("), ")[1].split()[0])
    assert head.startswith("# hybrid-commbench --soak 0.3 s: world 4 (gloo on cpu)") and rounds >= 1
    table = soak_rows(text)
    assert set(table) == {(k, op) for k in ("tp", "dp") for op in ("all_reduce", "send_recv")}
    for row in table.values():  # group, op, size, calls, median, p99, max, busbw, wrong, errors, slowest…
        assert row[2] == "4 KiB" and int(row[3]) == rounds and (row[8], row[9]) == ("0", "0")
        assert float(row[4]) <= float(row[5]) <= float(row[6])
        assert " ".join(row).count("round ") == min(3, rounds)  # the slowest calls, at most 3
    assert text.splitlines()[-1] == "# passed: no wrong result, no error"


def test_a_soak_stops_at_the_first_error_and_counts_a_wrong_result() -> None:
    code, text = launched(4)["soak"][0]["broken"]
    assert code == 1 and text.splitlines()[-1] == ("# FAILED: dp all_reduce, round 3: Timed out waiting 300000ms for "
                                                   "recv operation to complete"), text
    table = soak_rows(text)
    assert table[("dp", "all_reduce")][9] == "1" and table[("tp", "all_reduce")][9] == "0"
    assert {int(r[3]) for r in table.values()} == {2}  # the rounds every (group, op) completed
    results = launched(2)["soak_corrupted"]
    assert [c for c, _ in results] == [1, 1]
    rows_2 = soak_rows(results[0][1])
    assert int(rows_2[("world", "all_reduce")][8]) >= 1 and rows_2[("world", "send_recv")][8] == "0"
    assert "(gloo on cpu)" in results[0][1] and "wrong element(s)" in results[0][1].splitlines()[-1]


@functools.cache
def launched(world: int) -> dict[str, list[dict[str, Any]]]:
    """check → its results by rank, from the one launch on `world` ranks."""
    torch.set_num_threads(1)
    compose_config(LAYOUT)  # what the groups check composes on every rank: once here, before the fork
    results = run_ranks(run_jobs, world)
    return {name: [r[name] for r in results] for name in results[0]}


def test_preflight_flags_a_slow_rank() -> None:
    results = launched(3)["slow"]
    assert [r["code"] for r in results] == [1, 1, 1]
    assert results[0]["gemm_flags"] == [1] and len(results[0]["problems"]) == 1
    assert results[0]["problems"][0].startswith("rank 1 (")
    assert results[0]["problems"][0].endswith("GEMM 10 ms is 900% over the median 1 ms")
    assert [row[-1] == "GEMM" for row in rows(results[0]["text"])] == [False, True, False]  # the flag column
    assert "preflight: 1 problem(s)" in results[0]["text"].splitlines()[-1]


def test_preflight_passes_a_healthy_world() -> None:
    results = launched(3)["healthy"]
    assert [r["code"] for r in results] == [0, 0, 0], results[0]["text"]
    table = rows(results[0]["text"])  # every rank's seconds on its own row: rank, host, GEMM ms, …, link, link ms
    want = [(1.0, "0→1", 2.0), (1.1, "1→2", 2.1), (1.2, "2→0", 2.2)]
    assert [(float(r[2]), r[5], float(r[6])) for r in table] == want
    assert results[0]["text"].splitlines()[-1] == ("preflight: healthy (3 rank(s): GEMMs and 3 ring links within 20% "
                                                   "of the median, all-reduces correct)")


def test_the_saved_preflight_holds_its_figures_and_feeds_the_alerts() -> None:
    """`--save` (rank 0 writes): the made-up link and GEMM seconds by rank, the larger all-reduce's size and bus
    bandwidth, read back as a training run's `health.comm_preflight`."""
    launched(3)
    doc = json.loads(SAVED.read_text())
    assert (doc["world"], doc["gemm_s"], doc["link_s"], doc["problems"]) == (3, *HEALTHY, [])
    assert doc["allreduce"]["bytes"] == commbench.pf.plan_for(torch.device("cpu")).large
    big = doc["allreduce"]
    assert read_preflight(str(SAVED)) == {"busbw_gbps": big["busbw_gbps"], "bytes": big["bytes"], "world": 3}
    assert big["busbw_gbps"] > 0


def test_bad_input_is_one_line_per_rank() -> None:
    """The real entry point as the 2 ranks of a torchrun run (forked with torchrun's environment: the `[rankN]`
    prefix and the linger for the peers' lines use it; tests/e2e/test_torchrun.py runs the real torchrun)."""
    runs = run_forked_ranks(commbench.main, ["-o", "bogus"], ROOT, 2, {"OMP_NUM_THREADS": "1"})
    assert [r.code for r in runs] == [2, 2]
    ours = [ln for r in runs for ln in r.error_lines()]
    assert sorted(ln.split()[0] for ln in ours) == ["[rank0]", "[rank1]"], [r.stderr for r in runs]
    assert all("unknown op 'bogus'" in ln for ln in ours)
    assert all("Traceback" not in r.stderr for r in runs)
