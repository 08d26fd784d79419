"""`hybrid-memory`: the per-stage table, the verdict and the largest micro batch; bad input as one line."""

from __future__ import annotations

import pytest
import torch

from hybrid.config import compose_config
from hybrid.memory import largest_micro_batch, meta_stages, stage_estimates
from hybrid.parallel.context import Layout
from hybrid.record.metrics import format_bytes
from hybrid.tools.memory import main, parse_size
from hybrid.trainer import build_chunks

ARGS = ["model=gpt-tiny", "parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2", "train.global_batch_size=16"]


def test_the_table_is_the_estimate_of_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--world", "8", "--vocab", "1000", "--memory", "1GiB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    cfg = compose_config(ARGS)
    layout = Layout.create(8, tp=2, pp=2)
    real = []  # the reference: each stage's chunks really built (CPU tensors), not on the meta device
    for chunks in meta_stages(layout, lambda ctx: build_chunks(cfg, 1000, ctx)):
        assert all(p.is_meta for p in chunks.parameters())
    with torch.device("cpu"):
        from hybrid.parallel.context import ParallelContext

        real = [build_chunks(cfg, 1000, ParallelContext.shapes(layout, layout.rank(p, 0, 0))) for p in range(2)]
    estimates = stage_estimates(cfg, layout, real, "cpu")
    rows = [line.split() for line in out if line.split() and line.split()[0] in ("0", "1")]
    for row, est in zip(rows, estimates, strict=True):
        assert " ".join(row[-2:]) == format_bytes(est.total), (row, est)
    assert f"fits; largest micro batch that fits: {largest_micro_batch(cfg, layout, real, 'cpu', 2**30)}" in out[-1]
    assert largest_micro_batch(cfg, layout, real, "cpu", 2**30) >= 2


@pytest.mark.parametrize("argv,needle", [
    (["--memory", "lots"], "--memory 'lots' is not a size"),
    (["--bogus"], "unknown flag --bogus"),
    (["--world"], "--world needs a value"),
    (["parallel.tp=2", "--world", "3"], "does not divide"),
    (["--device", "tpu"], "--device 'tpu' is not cpu or cuda"),
    (["model=nope"], "nope"),
])
def test_bad_input_is_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("hybrid: error:") and needle in err[0], err


def test_sizes() -> None:
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("80 GB") == 80 * 10**9 and parse_size("1000") == 1000


def test_a_cp_rank_is_estimated_at_its_share_of_the_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    """At cp4 the header names the axis and a rank's tokens; the activations are cp1's at a quarter of the tokens
    (seq 512 at cp4 against seq 128 at cp1, the same microbatch)."""
    cp = ["model=gpt-tiny", "model.max_seq_len=512", "train.micro_batch_size=2", "train.global_batch_size=2"]
    assert main([*cp, "parallel.cp=4", "data.seq_len=512", "--world", "4", "--vocab", "1000"]) == 0
    at_cp4 = capsys.readouterr().out.splitlines()
    assert "cp4 (ring: seq 128 a rank)" in at_cp4[0]
    assert main([*cp, "data.seq_len=128", "--world", "1", "--vocab", "1000"]) == 0
    at_cp1 = capsys.readouterr().out.splitlines()
    activations = [next(line.split()[7:9] for line in out if line.split()[:1] == ["0"]) for out in (at_cp4, at_cp1)]
    assert activations[0] == activations[1]


@pytest.mark.parametrize("world,layout,zero_group", [
    (8, {"dp": 4, "cp": 2}, "dp"), (8, {"dp": 2, "cp": 2, "tp": 2}, "dp"), (8, {"dp": 8}, "dp"),
    (8, {"dp": 4, "cp": 2, "ranks_per_node": 4}, "node"), (8, {"dp": 4, "pp": 2}, "2")])
def test_the_estimate_shards_over_the_runs_own_zero_groups(world: int, layout: dict, zero_group: str) -> None:
    """The ranks the estimate divides ZeRO's states by are the size of the shard group the run builds (under CP,
    the cp·dp ranks that average the gradients)."""
    from hybrid.memory import shard_dp
    from hybrid.sync.zero import shard_lists

    lay = Layout.create(world, **layout)
    cfg = compose_config(["model=gpt-tiny", "parallel.zero=1", f"parallel.zero_group={zero_group}"])
    assert shard_dp(cfg, lay) == len(shard_lists(cfg, lay)[0][0])


def test_a_run_that_does_not_fit_is_told_the_zero_stage_that_would(capsys: pytest.CaptureFixture[str]) -> None:
    """Each higher ZeRO stage's largest rank (the estimate of the same chunks), up to the first that fits: at
    gpt-350m's width, 14 layers, pp2dp4, ZeRO-1 is not enough in 1.7 GiB, ZeRO-2 is."""
    args = ["model=gpt-350m", "model.n_layers=14", "parallel.pp=2", "train.recompute=full", "data.seq_len=256",
            "train.micro_batch_size=1", "train.global_batch_size=8"]
    assert main([*args, "--world", "8", "--memory", "1.7GiB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    advice = [line for line in out if line.startswith("with parallel.zero=")]
    layout = Layout.create(8, pp=2)
    chunks = meta_stages(layout, lambda ctx: build_chunks(compose_config(args), 50257, ctx))
    for line, zero in zip(advice, range(1, 4), strict=False):
        cfg = compose_config([*args, f"parallel.zero={zero}"])
        worst = max(e.total for e in stage_estimates(cfg, layout, chunks, "cpu"))
        assert line.startswith(f"with parallel.zero={zero}: {format_bytes(worst)}: "), (line, worst)
    assert [a.rsplit(": ", 1)[1] for a in advice] == ["does not fit", "fits"], out
