"""`hybrid.bench.checkpoint_size` and `checkpoint_async`: their pure parts, and both end to end in `--quick` mode
(no timing assertions: only that the figures exist and that the bytes on disk match the analytic formula)."""

from __future__ import annotations

import pytest
import torch

from hybrid.bench import checkpoint_async, checkpoint_size
from hybrid.bench.checkpoint_common import layout, world


def test_quick_defaults_reproduce_command_and_cli() -> None:
    args = checkpoint_async.parse_args(["--quick", "--steps", "3"])
    assert args.model == "gpt-tiny" and checkpoint_size.parse_args(["--quick"]).model == "gpt-tiny"
    assert args.rounds == 1
    assert args.steps == 3  # an explicit option wins over QUICK's
    command = checkpoint_async.reproduce_command(args)
    assert "--quick" not in command and "--steps 3" in command and "--layout tp2pp2dp2" in command
    full = checkpoint_size.parse_args([])
    assert full.model == "gpt-350m" and full.layout == "tp2pp2dp2" and not hasattr(full, "sections")
    full_async = checkpoint_async.parse_args([])
    assert full_async.model == "gpt-125m" and full_async.layout == "tp2pp2dp2"
    assert layout("tp2pp4dp1") == {"tp": 2, "pp": 4, "dp": 1} and world("tp2pp2dp2") == 8
    for bad in (["--sections", "size"], ["--model", "no-such-model"], ["--layout", "tp2pp2"],
                ["--layout", "tp1pp1dp1"], ["--global-batch", "7"]):
        with pytest.raises(SystemExit):
            checkpoint_size.parse_args(bad)
    with pytest.raises(SystemExit):
        checkpoint_async.parse_args(["--steps", "0"])


def _flight(starts: list[float], length: float) -> list[tuple[float, float]]:
    return [(s, s + length) for s in starts]


def test_async_round_overlap_and_in_flight_steps() -> None:
    # two ranks; the save starts at 0, staging ends at 1 (rank 1) and the write at 4.5 (rank 0's callback)
    ranks = [[{"plain": _flight([-10, -9], 1.0), "sync": (-8.0, -6.0), "async": (0.0, 0.9, 4.5, 6.2),
               "copy": (0.3, 0.7), "flight": _flight([1, 2, 3, 4, 5], 1.0)}],
             [{"plain": _flight([-10, -9], 0.9), "sync": (-8.0, -5.5), "async": (0.0, 1.0, 4.0, 6.1),
               "copy": (0.2, 0.8), "flight": _flight([1.1, 2.1, 3.1, 4.1, 5.1], 1.0)}]]
    r = checkpoint_async.async_round(ranks, 0)
    assert r["plain"] == [1.0, 1.0] and r["flight"] == pytest.approx([1.0] * 5)
    assert len(r["in_flight"]) == 4  # steps starting at 1, 2, 3, 4 began before 4.5
    assert r["sync_s"] == 2.5 and r["block_s"] == 1.0 and r["copy_s"] == pytest.approx(0.6)  # slowest rank's copy
    assert r["window_s"] == 3.5 and r["async_total_s"] == 4.5
    assert r["overlap"] == pytest.approx(1.0)  # the steps span 1..6.1, the window 1..4.5
    assert r["wait_s"] == pytest.approx(6.2 - 6.1)
    late = [[{**ranks[0][0], "async": (0.0, 1.0, 10.0, 10.0)}], ranks[1]]
    assert checkpoint_async.async_round(late, 0)["overlap"] == pytest.approx((6.1 - 1.0) / 9.0)


def test_quick_run_both_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        result = {"size": checkpoint_size.run(checkpoint_size.parse_args(["--quick"])),
                  "async": checkpoint_async.run(checkpoint_async.parse_args(["--quick"]))}
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for needle in ("# command: OMP_NUM_THREADS=1", "## size: gpt-tiny, sharded at tp2pp2dp2 on 8", "## async: gpt-tiny",
                   "| sharded DCP (8 ranks)", "| torch.save (1 process)", "| ratio sharded / single",
                   "analytic 12·N B", "bytes on disk", "save s", "load s", "in-flight window s",
                   "of which staging copy s", "async blocking, first save",
                   "window overlapped by steps", "reproduce: OMP_NUM_THREADS=1"):
        assert needle in out, needle
    size = result["size"]
    assert all(size["checks"].values()), size["checks"]
    sharded, single, n, n_one = size["sharded"], size["single"], size["n_tp"], size["n_one"]
    # DCP's index: exactly param + exp_avg + exp_avg_sq in fp32, plus one fp32 step per parameter
    assert sharded["model_data"] == 4 * n
    assert sharded["data"] == 12 * n + 4 * size["n_tensors"]
    # the shard files: those tensors, each with at most DCP_FRAMING bytes of torch.save framing, and the
    # per-rank RNG / hook blobs; nothing else
    framing = sharded["tensor_len"] - sharded["data"]
    assert sharded["shards"] == sharded["data"] + framing + sharded["bytes_len"]
    assert 0 < framing <= checkpoint_size.DCP_FRAMING * sharded["tensor_items"]
    assert sharded["bytes"] == sharded["shards"] + sharded["metadata"] + sharded["manifest"]
    # each DP replica's shards written once: the ranks hold > 2× the state, the checkpoint ~1×
    assert size["held"] > 2 * 12 * n and sharded["bytes"] < 1.05 * 12 * n
    # one torch.save of the whole (tp=1) state: 12·N plus its pickle, well under 2 KiB per tensor
    assert 12 * n_one < single["bytes"] <= 12 * n_one + 2048 * 3 * size["n_tensors"]
    assert min(sharded["save_s"], sharded["load_s"], single["save_s"], single["load_s"]) > 0
    timing = result["async"]
    assert len(timing["rounds"]) == 1 and len(timing["rounds"][0]["flight"]) == 1  # --quick: 1 step in flight
    assert min(timing["plain_s"], timing["flight_s"], timing["sync_s"], timing["block_s"]) > 0
    assert 0 < timing["copy_s"] < timing["block_s"]  # the staging copy is part of the blocking time
    assert timing["window_s"] >= 0 and 0 <= timing["overlap"] <= 1
    # at tp2pp2dp2 (fused QKV parts are DTensor views at nonzero offsets): every rank staged its whole state
    assert "## async: gpt-tiny" in out and "at tp2pp2dp2 on 8 ranks" in out
    # every rank stages its whole state dict (2 DP replicas: > 2·12·N) but not the tied head's copy (< held)
    assert 2 * 12 * timing["n"] < timing["staging_bytes"] < size["held"]
