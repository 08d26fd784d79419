"""hybrid-commbench in one process: nccl-tests' bandwidth formulas, sizes, the correctness check, the
preflight's arithmetic, and bad input as one line with exit status 2.

References: nccl-tests' definitions (doc/PERFORMANCE.md there): algbw = S / t; busbw = algbw · 2(n−1)/n
for all-reduce (each rank sends and receives 2(n−1)/n·S in a ring), (n−1)/n for all-gather,
reduce-scatter and all-to-all (each rank receives all but its own 1/n of S), 1 for broadcast and
point-to-point; S is the size column: the all-gather's output, the reduce-scatter's input. The
factors below are those fractions written out per n, not read from the code.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from hybrid.diagnostics import bandwidth as bw
from hybrid.diagnostics import preflight as pf
from hybrid.tools import commbench
from hybrid.tools.commbench_backends import compare


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 2, 2 * 1 / 2), ("all_reduce", 3, 2 * 2 / 3), ("all_reduce", 4, 2 * 3 / 4),
    ("all_reduce", 8, 2 * 7 / 8), ("all_gather", 2, 1 / 2), ("all_gather", 4, 3 / 4), ("reduce_scatter", 8, 7 / 8),
    ("reduce_scatter", 3, 2 / 3), ("all_to_all", 4, 3 / 4), ("broadcast", 8, 1.0), ("send_recv", 4, 1.0),
])
def test_busbw_is_algbw_times_nccl_tests_factor(op: str, n: int, factor: float) -> None:
    size, seconds = 3 * 2 ** 20, 1.5e-3
    assert bw.algbw(size, seconds) == pytest.approx(size / seconds / 1e9)
    assert bw.busbw(op, n, size, seconds) == pytest.approx(size / seconds / 1e9 * factor)


def test_algbw_in_gb_per_second() -> None:
    assert bw.algbw(10 ** 9, 0.5) == pytest.approx(2.0)
    assert bw.algbw(1024, 0.0) == 0.0


def test_size_column_counts_whole_chunks_per_rank() -> None:
    # all-gather: the output (n chunks), reduce-scatter: the input (n chunks), a multiple of n elements
    assert bw.element_count("all_gather", 4096, 4, 4) == 1024
    assert bw.element_count("all_gather", 4100, 4, 4) == 1024  # rounded down to n whole chunks
    assert bw.element_count("reduce_scatter", 8, 4, 4) == 4  # at least one element per rank
    assert bw.element_count("all_to_all", 48, 3, 4) == 12
    assert bw.element_count("all_reduce", 6, 4, 4) == 1  # whole elements, at least one
    assert bw.element_count("broadcast", 4096, 4, 2) == 2048


def test_sizes_step_by_the_factor_up_to_the_maximum() -> None:
    assert bw.sizes(8, 1024, 4) == [8, 32, 128, 512]
    assert bw.sizes(8, 8, 2) == [8]
    assert bw.sizes(1, 2 ** 20, 2)[-1] == 2 ** 20


@pytest.mark.parametrize("text,nbytes", [("8", 8), ("1K", 1024), ("64k", 64 * 1024), ("16KB", 16 * 1024),
                                         ("4MiB", 4 * 2 ** 20), ("128M", 128 * 2 ** 20), ("2G", 2 * 2 ** 30)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert commbench.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["0", "-1", "abc", "1.5M", "", "4T"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(commbench.UsageError):
        commbench.parse_size(text)


@pytest.mark.parametrize("n", [3, 5])
def test_expected_results_follow_each_ops_definition(n: int) -> None:
    count, f32 = 6 * n, torch.float32
    fills = {op: [bw.fill(op, r, count, f32).double() for r in range(n)] for op in bw.OPS}
    c = count // n
    assert torch.equal(bw.expected("all_reduce", 1, n, count), sum(fills["all_reduce"]))
    assert torch.equal(bw.expected("reduce_scatter", 2, n, count), sum(fills["reduce_scatter"])[2 * c:3 * c])
    gathered = torch.cat([bw.fill("all_gather", r, c, f32).double() for r in range(n)])
    assert torch.equal(bw.expected("all_gather", 0, n, count), gathered)
    # all-to-all: rank 1 receives chunk 1 of every rank's input, in rank order
    chunks_1 = torch.cat([x[c:2 * c] for x in fills["all_to_all"]])
    assert torch.equal(bw.expected("all_to_all", 1, n, count), chunks_1)
    assert torch.equal(bw.expected("broadcast", 2, n, count), fills["broadcast"][0])
    assert torch.equal(bw.expected("send_recv", 0, n, count), fills["send_recv"][n - 1])  # ring: from r−1


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "send_recv"])
def test_expected_with_fewer_elements_than_ranks(op: str) -> None:
    fills = [bw.fill(op, r, 2, torch.float32).double() for r in range(4)]
    want = {"all_reduce": sum(fills), "broadcast": fills[0], "send_recv": fills[3]}[op]
    assert torch.equal(bw.expected(op, 0, 4, 2), want)


@pytest.mark.parametrize("op", bw.OPS)
def test_expected_by_blocks_is_a_slice_of_the_whole(op: str) -> None:
    whole = bw.expected(op, 2, 4, 40)
    assert torch.equal(torch.cat([bw.expected(op, 2, 4, 40, lo, min(lo + 3, len(whole)))
                                  for lo in range(0, len(whole), 3)]), whole)


def test_fills_are_exact_and_rank_dependent_in_every_dtype() -> None:
    for name, dtype in bw.DTYPES.items():
        for op in bw.OPS:
            a, b = bw.fill(op, 0, 64, dtype), bw.fill(op, 1, 64, dtype)
            assert torch.equal(a.double(), bw.fill(op, 0, 64, torch.float64)), (name, op)
            assert not torch.equal(a, b)


def test_count_wrong_counts_elements_and_nans() -> None:
    want = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert bw.count_wrong(want.to(torch.bfloat16), want, 4) == 0
    bad = want.clone().float()
    bad[1], bad[3] = 2.5, math.nan
    assert bw.count_wrong(bad, want, 4) == 2
    assert bw.count_wrong(torch.tensor([1, 2, 3, 5], dtype=torch.int32), want, 4) == 1


def test_over_median_flags_only_what_exceeds_the_threshold() -> None:
    assert pf.over_median([1.0, 1.1, 0.9, 10.0], 20) == [3]
    assert pf.over_median([1.0, 1.1, 0.9, 1.15], 20) == []
    assert pf.over_median([1.0, math.nan], 20) == []  # one finite value: nothing to compare with
    assert pf.excess([1.0, 2.0, 3.0], 2) == pytest.approx(50.0)


def test_a_slow_gemm_is_in_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemm_seconds` times each GEMM after the warm-ups: a matmul that sleeps DELAY seconds takes at least that (a
    lower bound, whatever else runs on the machine)."""
    delay, real = 0.02, torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: (time.sleep(delay), real(a, b))[1])
    plan = pf.Plan(small=4, large=4, link=4, gemm=4, dtype=torch.float32, iters=2, warmup=1)
    assert pf.gemm_seconds(plan, torch.device("cpu")) >= delay


@pytest.mark.parametrize("n", range(2, 10))
def test_link_phases_time_every_ring_link_once_without_shared_ranks(n: int) -> None:
    phases: dict[int, list[tuple[int, int]]] = {}
    for k in range(n):
        phases.setdefault(pf.link_phase(k, n), []).append((k, (k + 1) % n))
    assert sorted(link for links in phases.values() for link in links) == [(k, (k + 1) % n) for k in range(n)]
    for links in phases.values():
        ranks = [r for link in links for r in link]
        assert len(ranks) == len(set(ranks)), links
    assert len(phases) == (3 if n % 2 else 2)


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("argv,needle", [
    (["-o", "bogus"], "unknown op 'bogus'"),
    (["-o", "all_reduce,nope"], "unknown op 'nope'"),
    (["-d", "float8"], "unknown dtype 'float8'"),
    (["-b", "1M", "-e", "1K"], "is larger than -e 1K"),
    (["-f", "1"], "-f must be an integer >= 2"),
    (["-f", "two"], "-f/--stepfactor"),
    (["-n", "0"], "need -n >= 1"),
    (["-w", "-1"], "need -n >= 1 and -w >= 0"),
    (["-b", "0"], "size must be a positive number of bytes"),
    (["-e", "12X"], "size must be a positive number of bytes"),
    (["--bogus"], "unrecognized argument '--bogus'"),
    (["-c", "2"], "-c/--check"),
    (["--groups", "tp,xx"], "unknown group kind 'xx'"),
    (["--groups", "tp"], "needs a layout"),
    (["--threshold", "10"], "--threshold needs --preflight"),
    (["--save", "pf.json"], "--save pf.json: writes the preflight's figures, so it needs --preflight"),
    (["--preflight", "--save", "/nonexistent/pf.json"], "needs --preflight and a folder that exists"),
    (["parallel.tp=2"], "does not divide world size 1"),
    (["parallel=tp9"], "Could not find 'parallel/tp9'"),
    (["--soak", "0"], "--soak must be a positive duration"),
    (["--soak", "ten"], "--soak must be a positive duration"),
    (["--soak", "10", "--preflight"], "--soak and --preflight are two different runs"),
    (["--backend", "mpi"], "--backend must be gloo, nccl or gloo,nccl"),
    (["--backend", "gloo,gloo"], "--backend must be gloo, nccl or gloo,nccl"),
    (["--backend", "nccl"], "--backend nccl needs a CUDA GPU"),  # the suite hides the GPUs
    (["--backend", "gloo,nccl"], "--backend nccl needs a CUDA GPU"),
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], needle: str, one_process: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert commbench.run(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("hybrid: error: ") and needle in err, err
    assert not torch.distributed.is_initialized()


def test_help_and_a_world_of_one(one_process: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert commbench.main(["-h"]) == 0
    assert "--preflight" in capsys.readouterr().out
    assert commbench.run(["-o", "all", "-e", "64"]) == 0
    assert "nothing to measure" in capsys.readouterr().out
    assert commbench.run(["--preflight"]) == 0
    out = capsys.readouterr().out
    assert "GEMM 256×256" in out and out.rstrip().endswith("nothing to compare in a world of one)")
    assert not torch.distributed.is_initialized()


def test_the_comm_peak_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid.bench import comm_peak

    result = comm_peak.run(comm_peak.parse_args(["--quick"]))
    assert [(p["world"], p["op"], p["code"]) for p in result["peaks"]] == [(2, "all_reduce", 0), (2, "all_gather", 0)]
    assert all(p["ratio"] == pytest.approx(p["busbw"] / result["copy_gbps"]) for p in result["peaks"])
    out = capsys.readouterr().out
    assert "## memcpy" in out and "# Avg bus bandwidth" in out and "reproduce: OMP_NUM_THREADS=1" in out


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("1.5", 1.5), ("10m", 600.0), ("2h", 7200.0)])
def test_soak_durations(text: str, seconds: float) -> None:
    assert commbench.parse_duration(text) == seconds


def test_soak_in_a_world_of_one_and_the_backend_comparison(one_process: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert commbench.run(["--soak", "0.1", "--backend", "gloo"]) == 0
    assert "nothing to measure" in capsys.readouterr().out
    cell = lambda gbs: bw.Cell(1e-3, 1e-3, 1e-3, 0, 0, gbs, gbs, 0)  # noqa: E731
    table = lambda gbs: bw.Table("all_reduce", "float32", bw.GroupSet("dp", ((0, 1),)),  # noqa: E731
                                 [bw.Row(1024, 256, cell(gbs), cell(gbs)), bw.Row(4096, 1024, cell(0.0), None)])
    text = compare([table(2.0)], [table(50.0)], ["gloo", "nccl"]).splitlines()
    assert text[1] == "# ===== gloo against nccl: bus bandwidth (GB/s, out of place) on the same sizes"
    assert text[3].split() == ["dp", "all_reduce", "1", "KiB", "2.000", "50.000", "25.00×"]
    assert text[4].split()[-1] == "-"  # nothing measured under the first backend: no ratio
