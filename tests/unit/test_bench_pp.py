"""`hybrid.bench.pp_*`: their pure parts, and pp_bubble, pp_torch and pp_bytes end to end at tiny sizes (no timing
assertions: only that the figures exist and the exact ones agree)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from hybrid.bench import memory, pp_bubble, pp_bytes, pp_headline, pp_torch, zb_memory
from hybrid.memory import meta_stages, micro_of, training_schedule
from hybrid.trainer import build_chunks
from hybrid.validation import validate

RUN = ["--vocab", "300", "--seq", "16", "--micro-batch", "1", "--timeout", "120"]
TINY = [*RUN, "--layers", "4", "--microbatches", "2", "--steps", "1", "--warmup", "0"]  # pp_bubble and pp_torch
TINY_BYTES = [*RUN, "--layers", "8"]


def test_analytic_and_measured_bubble() -> None:
    assert pp_bubble.analytic_bubble(2, 4) == pytest.approx(1 / 5)
    assert pp_bubble.analytic_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert pp_bubble.analytic_bubble(4, 8, 1, "zb1p") == pytest.approx(3 / 27)  # (p−1)/(3m+p−1) at F = I = W
    # two ranks, two steps: each step lasts as long as its slowest rank
    walls, busy = [[1.0, 2.0], [0.5, 4.0]], [[0.5, 2.0], [0.25, 3.0]]
    assert pp_bubble.measured_bubble(walls, busy) == pytest.approx([(0.5 + 0.5) / 2, (0.75 + 0.25) / 2])


def test_bottleneck_bubble_matches_the_simulator_for_equal_stages() -> None:
    equal = pp_bubble.bottleneck_bubble("1f1b", 2, 4, 1, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0])
    assert equal == pytest.approx([pp_bubble.analytic_bubble(2, 4)] * 2)
    split = pp_bubble.bottleneck_bubble("zb1p", 4, 8, 1, [1.0] * 4, [2.0] * 4, [1.0] * 4)
    assert split == pytest.approx([pp_bubble.analytic_bubble(4, 8, 1, "zb1p")] * 4)
    slow_last = pp_bubble.bottleneck_bubble("1f1b", 2, 4, 1, [1.0, 2.0], [2.0, 4.0], [0.0, 0.0])
    assert slow_last[0] > slow_last[1]  # the faster first stage waits for the last


def test_proc_status_parsing_and_sampler_sees_a_child() -> None:
    assert memory.proc_status_kb("Name:\tx\nVmHWM:\t  1234 kB\nVmRSS:\t  99 kB\n", "VmHWM") == 1234
    assert memory.proc_status_kb("Name:\tx\n", "VmHWM") == 0
    child = subprocess.Popen(["sleep", "5"], env={**os.environ, "RANK": "0"})  # like a torchrun worker
    try:
        peaks: dict[str, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=memory.sample_peaks, args=(os.getpid(), stop, peaks, 0.05))
        sampler.start()
        time.sleep(0.5)
        stop.set()
        sampler.join()
        assert child.pid in memory.descendants(os.getpid())
        assert peaks.get("0", 0) > 0 and peaks["total"] > 0  # VmHWM of the RANK=0 child, kB
    finally:
        child.kill()
        child.wait()


def test_headline_command_and_cli() -> None:
    cmd = pp_headline.headline_command("/tmp/x")
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc_per_node", "8", "-m"]
    assert "model=gpt-1b" in cmd and "parallel=tp2pp4" in cmd and cmd[-1] == "logging.dir=/tmp/x"
    assert "--torchrun-timeout 900.0" in pp_headline.reproduce_command(pp_headline.parse_args([]))
    for module, tiny in ((pp_bubble, TINY), (pp_torch, TINY), (pp_bytes, TINY_BYTES)):
        args = module.parse_args(tiny)
        assert "--sections" not in module.reproduce_command(args)  # one question per module
        assert "--seq 16" in module.reproduce_command(args)
        assert module.parse_args(["--quick"]).seq == 16  # --quick: the tiny sizes
    for module, bad in ((pp_bubble, ["--sections", "nope"]), (pp_bytes, ["--model", "no-such-model"]),
                        (pp_bubble, ["--microbatches", "3"]), (pp_torch, ["--layers", "2"])):
        with pytest.raises(SystemExit):
            module.parse_args([*RUN, *bad])


def test_benchmarks_run_bytes_agree_and_torch_grads_match(capsys: pytest.CaptureFixture[str]) -> None:
    result = {"bubble": pp_bubble.run(pp_bubble.parse_args(TINY)),
              "torch": pp_torch.run(pp_torch.parse_args(TINY)),
              "bytes": pp_bytes.run(pp_bytes.parse_args(TINY_BYTES))}
    out = capsys.readouterr().out
    for needle in ("# command: OMP_NUM_THREADS=1", "## bubble", "## torch", "## bytes_pp", "does not model",
                   "ratio ours/torch", "reproduce:"):
        assert needle in out
    bubble = {(r["schedule"], r["m"]): r for r in result["bubble"]}
    assert set(bubble) == {("gpipe", 2), ("1f1b", 2), ("interleaved", 2), ("zb1p", 2), ("zbv", 2)}
    assert bubble["zb1p", 2]["w"] > 0 and bubble["1f1b", 2]["w"] == 0  # the weight passes, measured apart
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


def test_zb_memory_runs_the_fitted_schedule_the_trainer_would(capsys: pytest.CaptureFixture[str]) -> None:
    """The bench's fitted zb1p is `memory.training_schedule`'s for the same config, and ZB-H1 holds more on the
    last rank than 1F1B, measured."""
    args = zb_memory.build_parser().parse_args([*RUN, "--vocab", "4096", "--layers", "4", "--pp", "2",
                                                "--microbatches", "4", "--rounds", "3"])
    ranks = zb_memory.run(args)
    cfg = zb_memory.configs(args)[2]
    layout = validate(cfg, 2, 2)
    want = training_schedule(cfg, layout, meta_stages(layout, lambda c: build_chunks(cfg, 4096, c)), micro_of(cfg))
    assert ranks[0]["labels"][2] == want.label and want.deferrals
    assert ranks[1]["peak"][1] > ranks[1]["peak"][0]
    assert "largest rank" in capsys.readouterr().out
