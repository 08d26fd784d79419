"""`hybrid.bench.pp`: its pure parts, and the bubble, torch and bytes sections end to end at tiny sizes (no timing
assertions: only that the figures exist and the exact ones agree)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from hybrid.bench import pp

TINY = ["--layers", "4", "--vocab", "300", "--seq", "16", "--micro-batch", "1", "--microbatches", "2",
        "--torch-microbatches", "2", "--steps", "1", "--torch-steps", "1", "--warmup", "0", "--bytes-layers", "8",
        "--timeout", "120"]


def test_analytic_and_measured_bubble() -> None:
    assert pp.analytic_bubble(2, 4) == pytest.approx(1 / 5)
    assert pp.analytic_bubble(4, 8, 2) == pytest.approx(3 / 19)
    # two ranks, two steps: each step lasts as long as its slowest rank
    walls, busy = [[1.0, 2.0], [0.5, 4.0]], [[0.5, 2.0], [0.25, 3.0]]
    assert pp.measured_bubble(walls, busy) == pytest.approx([(0.5 + 0.5) / 2, (0.75 + 0.25) / 2])


def test_bottleneck_bubble_matches_the_simulator_for_equal_stages() -> None:
    equal = pp.bottleneck_bubble("1f1b", 2, 4, 1, [1.0, 1.0], [2.0, 2.0])
    assert equal == pytest.approx([pp.analytic_bubble(2, 4)] * 2)
    slow_last = pp.bottleneck_bubble("1f1b", 2, 4, 1, [1.0, 2.0], [2.0, 4.0])
    assert slow_last[0] > slow_last[1]  # the faster first stage waits for the last


def test_proc_status_parsing_and_sampler_sees_a_child() -> None:
    assert pp.proc_status_kb("Name:\tx\nVmHWM:\t  1234 kB\nVmRSS:\t  99 kB\n", "VmHWM") == 1234
    assert pp.proc_status_kb("Name:\tx\n", "VmHWM") == 0
    child = subprocess.Popen(["sleep", "5"], env={**os.environ, "RANK": "0"})  # like a torchrun worker
    try:
        peaks: dict[str, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=pp.sample_peaks, args=(os.getpid(), stop, peaks, 0.05))
        sampler.start()
        time.sleep(0.5)
        stop.set()
        sampler.join()
        assert child.pid in pp.descendants(os.getpid())
        assert peaks.get("0", 0) > 0 and peaks["total"] > 0  # VmHWM of the RANK=0 child, kB
    finally:
        child.kill()
        child.wait()


def test_headline_command_and_cli() -> None:
    cmd = pp.headline_command("/tmp/x")
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc_per_node", "8", "-m"]
    assert "model=gpt-1b" in cmd and "parallel=tp2pp4" in cmd and cmd[-1] == "logging.dir=/tmp/x"
    args = pp.parse_args(TINY)
    assert args.sections == ["bubble", "torch", "bytes"]  # headline only when named
    assert "--sections bubble,torch,bytes" in pp.reproduce_command(args)
    for bad in (["--sections", "nope"], ["--model", "no-such-model"], ["--microbatches", "3"], ["--layers", "2"]):
        with pytest.raises(SystemExit):
            pp.parse_args([*TINY, *bad])


def test_sections_run_bytes_agree_and_torch_grads_match(capsys: pytest.CaptureFixture[str]) -> None:
    result = pp.run(pp.parse_args(TINY))
    out = capsys.readouterr().out
    for needle in ("# command: OMP_NUM_THREADS=1", "## bubble", "## torch", "## bytes_pp", "does not model",
                   "ratio ours/torch", "reproduce:"):
        assert needle in out
    bubble = {(r["schedule"], r["m"]): r for r in result["bubble"]}
    assert set(bubble) == {("gpipe", 2), ("1f1b", 2), ("interleaved", 2)}
    for r in bubble.values():
        assert len(r["measured"]) == 2 and all(b < 1 for b in r["measured"])
        assert 0 < r["simulated"] < 1
    assert bubble["interleaved", 2]["analytic"] == pytest.approx(1 / 5)
    torch_row = result["torch"]
    assert torch_row["ours"] > 0 and torch_row["torch"] > 0 and torch_row["ratio"] > 0
    assert torch_row["grad_diff"] < 1e-6  # the same stage modules, microbatches and loss on both sides
    rows = result["bytes"]
    assert len(rows) == 2 * (2 + 4 + 4 + 4)  # (1f1b, interleaved) × every rank of pp2, pp4, tp2pp2, tp2pp2+SP
    assert all(r["equal"] for r in rows), [r for r in rows if not r["equal"]]
    sp = next(r for r in rows if r["sp"] and r["pp_rank"] == 0 and r["v"] == 1)
    plain = next(r for r in rows if r["tp"] == 2 and not r["sp"] and r["pp_rank"] == 0 and r["v"] == 1)
    assert 2 * sp["counted"]["send_fwd"] == plain["counted"]["send_fwd"]  # SP sends the s/t chunk
