"""hybrid.record.runlog: train.log as a tee of rank 0's stderr (held until the run is accepted, appended across
starts), the summary (Tally, summary.json, its line) and the end-of-run gather over forked gloo ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from hybrid.cli import say, warn
from hybrid.record import comm_env
from hybrid.record.metrics import format_bytes, format_duration
from hybrid.record.runlog import RunLog, Tally, gather, peak_memory, summary, summary_line, write_summary
from hybrid.record.sinks import MetricsLogger
from hybrid.testing.ranks import launch


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_every_stderr_line_reaches_train_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """say, warn, print to stderr, MetricsLogger messages and progress lines and the hybrid.* loggers'
    lines: held until `open`, then written after a header; stderr still gets them all."""
    err = sys.stderr
    with RunLog(True, "python -m hybrid.train x=1") as log:
        say("before the run dir is known")
        logging.getLogger("hybrid.data.corpus").info("building the data cache")
        log.open(tmp_path)
        warn("a warning")
        print("printed", file=sys.stderr)
        sys.stderr.write("part of ")
        sys.stderr.write("a line\n")
        sys.stderr.write("\rbar 1/3\rbar 3/3\n")  # a terminal bar's redraws: its last state
        with MetricsLogger(str(tmp_path), {}, True, 2, wandb_mode="disabled", progress=True) as m:
            m.log(2, {"loss": 1.5})
            m.message("hello")
        say("unfinished")
        sys.stderr.write("no newline")
    assert sys.stderr is err
    lines = _lines(tmp_path / "train.log")
    assert lines[0].startswith("==== ") and lines[0].endswith(f"start (pid {os.getpid()}): python -m hybrid.train x=1")
    assert lines[1:7] == ["before the run dir is known", "data.corpus: building the data cache", "hybrid: a warning",
                          "printed", "part of a line", "bar 3/3"]
    assert lines[7:] == ["step 2/2 loss=1.5 [0s]", "hello", "unfinished", "no newline"]
    assert "before the run dir is known" in capsys.readouterr().err


def test_a_run_never_accepted_writes_nothing_and_starts_append(tmp_path: Path) -> None:
    """No `open` (a refused or finished re-run): no file. Two starts: one file, two headers, in order;
    a Python exception leaves its traceback; SystemExit (hybrid.cli.fail) only its line."""
    with RunLog(True, "first") as log:
        log.open(tmp_path)
        say("one")
    with RunLog(True, "refused"):
        say("hybrid: error: refused")
    with pytest.raises(ValueError), RunLog(True, "second") as log:
        log.open(tmp_path)
        raise ValueError("a bug")
    with pytest.raises(SystemExit), RunLog(True, "third") as log:
        log.open(tmp_path)
        say("hybrid: error: bad")
        sys.exit(2)
    with RunLog(False, "other rank") as log:
        log.open(tmp_path)
        say("not mine")
    text = (tmp_path / "train.log").read_text()
    headers = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("==== ")]
    assert headers == ["first", "second", "third"]
    assert "refused" not in text and "not mine" not in text
    assert "ValueError: a bug" in text and "Traceback" in text and text.endswith("hybrid: error: bad\n")
    assert text.count("Traceback") == 1


def test_the_summary_agrees_with_the_logged_records(tmp_path: Path) -> None:
    """Final losses are the last logged ones; tokens/s is the mean over the logged steps after the first
    of this start; the file is written whole (no tmp file left) and the line names everything."""
    tally = Tally(start_step=10)
    with MetricsLogger(str(tmp_path), {}, True, 14, wandb_mode="disabled", progress=False, start_step=10,
                       extra=(tally,)) as m:
        for step, (loss, rate) in enumerate([(4.0, 10.0), (3.0, 30.0), (2.0, 50.0), (1.5, 70.0)], start=11):
            m.log(step, {"loss": loss, "tokens_per_s": rate})
        m.log_eval(14, 1.25)
    doc = write_summary(tmp_path, summary(tally, (14, 14), 192.4, [(2 * 2**30, 0), (3 * 2**30, 0)],
                                          torch.device("cpu"), ["/ck/step_0000014"], tmp_path / "train.log"))
    assert json.loads((tmp_path / "summary.json").read_text()) == doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert doc["final_loss"] == steps[-1]["loss"] and doc["first_loss"] == steps[0]["loss"]
    assert doc["final_eval_loss"] == rows[-1]["eval_loss"]
    assert doc["mean_tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in steps[1:]) / 3)
    assert (doc["start_step"], doc["end_step"], doc["ended"], doc["export"]) == (10, 14, "completed", None)
    line = summary_line(doc)
    assert line.startswith(f"done: 4 steps (to step 14) in {format_duration(192.4)}, loss 4 → 1.5, eval 1.25, 50 ")
    assert f"peak mem {format_bytes(3 * 2**30)}" in line and "checkpoint /ck/step_0000014" in line
    assert format_duration(192.4) == "3m12s" and format_bytes(3 * 2**30) == "3.0 GiB"
    stopped = summary(tally, (12, 14), 1.0, [(1, 0), (1, int(signal.SIGUSR1))], torch.device("cpu"), [], None)
    assert stopped["ended"] == "signal save (SIGUSR1)" and summary_line(stopped).startswith("stopped (signal save")


def _gathered(rank: int, world: int) -> list:
    return gather((rank * 10, peak_memory(torch.device("cpu")) > 0))


def test_gather_brings_every_ranks_value_in_rank_order() -> None:
    assert launch(_gathered, 2, timeout=120) == [[(0, True), (10, True)]] * 2
    assert gather(7) == [7]  # no process group: this process alone


def test_a_logged_step_reports_the_mean_time_of_its_window() -> None:
    """`StepWindow`: the mean over the steps since the last take; a step added `alone` (a start's first, warm-up)
    is dropped by the next add unless taken first; with nothing added, the fallback."""
    from hybrid.record.report import StepWindow

    w = StepWindow()
    assert w.take(0.5) == 0.5
    w.add(9.0, alone=True)
    for s in (1.0, 2.0, 3.0):
        w.add(s)
    assert w.take(0.5) == 2.0  # the warm-up step left out
    w.add(9.0, alone=True)
    assert w.take(0.5) == 9.0  # logged itself (log_every=1): reported
    w.add(4.0)
    assert w.take(0.5) == 4.0


def test_the_communication_record_keeps_only_the_libraries_settings() -> None:
    env = {"NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_BLOCKING_WAIT": "1", "GLOO_SOCKET_IFNAME": "eth0",
           "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "HOME": "/root", "MY_NCCL_NOTE": "x", "WANDB_API_KEY": "secret"}
    doc = comm_env.communication("gloo", env)
    assert doc == {"backend": "gloo", "nccl": None, "settings": {
        "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_NCCL_BLOCKING_WAIT": "1"}}
    assert comm_env.line(doc) == ("communication: gloo; GLOO_SOCKET_IFNAME=eth0 NCCL_IB_HCA=mlx5_0 "
                                  "TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_NCCL_BLOCKING_WAIT=1")
    assert comm_env.line(comm_env.communication("gloo", {})).endswith("no NCCL_*, TORCH_NCCL_* or GLOO_* settings "
                                                                      "in the environment")
    assert comm_env.line({"backend": "nccl", "nccl": "2.21.5", "settings": {}}).startswith("communication: nccl "
                                                                                           "2.21.5; ")
