"""The real command line, as ranks: `hybrid.train.main` forked from this process as the ranks of one run
(hybrid.testing.cli_runs.run_forked_ranks: torchrun's environment, gloo over a local port; each run's ranks
start in milliseconds), and launched where the launcher is the point:

- the shared uninterrupted 2-rank run (conftest's `tiny_reference`, forked) trains and logs;
- launch/multinode.sh started twice, as 2 emulated nodes of one rank each, meets at one c10d rendezvous and
  trains an interleaved pipeline across the nodes (pp2 × 2 chunks);
- forked: tp2 with sequence parallelism trains; dp2 with PowerSGD logs its compression metrics;
- torchrun: bad input (a layout the world torchrun starts does not fit: validate's refusal, made before the
  process group exists) is one line per rank, and torchrun's failure summary names exit status 2.

Other bad input as ranks is not repeated here: every refusal reaches the same edge (`hybrid.cli.fail`: the
`[rankN]` line, the status). tests/e2e/test_bad_inputs.py proves it per rank for a forked row
(test_bad_input_is_one_line_on_every_rank), through the real entry point for each way a refusal is reached
(test_bad_input_is_one_line_exit_2_nothing_written: the compression package's check, an unknown key among
them), and for the world-2 rows, the compression ones included, through the check before launch;
tests/unit/test_config.py has compression=hierarchical's own message (test_validate_rejects_bad_compression)
and an unknown config group option's one line and exit 2 (test_bad_input_is_one_line_and_exit_2).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hybrid.testing.cli_runs import CliRun

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["model=gpt-tiny", "data.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=4",
         "train.lr=3e-3", "optim.warmup_steps=2", "train.eval_every=4", "train.eval_batches=1",
         "logging.wandb.mode=disabled", "logging.progress=false", "logging.log_every=1"]
# the shared uninterrupted run (conftest's tiny_reference) and the fault-tolerance runs compared with it; dropout
# on: a resume is bit-exact only if every rank's RNG streams come back too; no traffic map (a picture no test
# here reads: a matplotlib import in each launched rank 0)
TINY = [*QUICK, "model.hidden=64", "model.n_layers=2", "model.dropout=0.1", "train.steps=8", "checkpoint.every=2",
        "checkpoint.keep=2", "logging.traffic_map=false"]
FORK_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def env(e2e_cache: str) -> dict[str, str]:
    """The environment of a launched run: one thread per rank, the session's data cache, this checkout first."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache, "PYTHONPATH": str(ROOT)}


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def torchrun(nproc: int, *overrides: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "hybrid.train", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def forked(world: int, *overrides: str, cwd: Path, env: dict[str, str]) -> list[CliRun]:
    """`hybrid.train.main` with `overrides` as the `world` ranks of one run, forked from this process (conftest's
    `forking` env: the process is ready for it), working in `cwd`; their results by rank."""
    import hybrid.train
    from hybrid.testing.cli_runs import run_forked_ranks

    return run_forked_ranks(hybrid.train.main, list(overrides), cwd, world, env, timeout_s=FORK_TIMEOUT_S)


def output(runs: list[CliRun]) -> str:
    """Everything the ranks printed, rank by rank."""
    return "".join(r.stdout + r.stderr for r in runs)


def assert_trained(runs: list[CliRun]) -> None:
    assert [r.code for r in runs] == [0] * len(runs), output(runs)[-4000:]


def test_two_ranks_train_and_log(tiny_reference: Any) -> None:
    """The shared uninterrupted run (conftest's tiny_reference: 2 forked ranks, TINY) trains and logs."""
    steps, evals, tmp = tiny_reference.steps, tiny_reference.evals, tiny_reference.tmp / "run"
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert len(evals) == 2 and evals[-1]["eval_loss"] < steps[0]["loss"]
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "bytes_dp"):
        assert key in steps[0]
    assert steps[0]["bytes_dp"] > 0  # gradients were all-reduced over dp=2
    assert "layout: world=2 = pp1 × dp2 × tp1" in tiny_reference.out
    assert (tmp / ".hydra" / "config.yaml").exists()


def test_emulated_two_nodes_with_multinode_sh_train_an_interleaved_pipeline(tmp_path: Path,
                                                                            env: dict[str, str]) -> None:
    """Two multinode.sh agents (node ranks 0 and 1, one rank each) meet at one c10d rendezvous; the pipeline's
    two stages, one per emulated node, train: the last stage's loss reaches rank 0's log. The layers are split by
    predicted time (`parallel.stage_layers=auto`): the split the start-up line names is the one built.
    (HYBRID_CHECK=0: the check before launch is tests/e2e/test_bad_inputs.py's; here it would be one more fresh
    process per node.)"""
    port = str(29400 + os.getpid() % 500)
    args = ["--nnodes", "2", "--nproc", "1", "--endpoint", f"127.0.0.1:{port}", "--run-id", f"e2e{os.getpid()}",
            "--max-restarts", "0", *QUICK, "parallel=pp2", "parallel.schedule=interleaved",
            "parallel.virtual_stages=2", "parallel.stage_layers=auto", "model.hidden=64", "train.steps=6",
            "logging.traffic_map=false",
            f"logging.dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'ck'}"]  # multinode.sh adds checkpoint.resume=auto: nothing stale there
    procs = [subprocess.Popen(["bash", str(ROOT / "launch" / "multinode.sh"), "--node-rank", str(n), *args],
                              cwd=ROOT, env={**env, "HYBRID_CHECK": "0"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    out = "".join(outs)
    assert "layout: world=2 = pp2 × dp1 × tp1, 2 node(s) × 1 ranks" in out
    split = re.search(r"stage balance \(parallel.stage_layers=auto\): layers per part (\[[\d, ]+\])", out)
    assert split and sum(json.loads(split.group(1))) == 4, out[-3000:]
    assert f"pipeline: schedule interleaved, pp=2 × 2 chunk(s), 4 microbatches, layers per part {split.group(1)}" in out
    steps, evals = read_metrics(tmp_path)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3  # the last stage's loss reached rank 0's log
    assert evals and evals[-1]["eval_loss"] < steps[0]["loss"]
    assert steps[0]["bytes_pp"] > 0 and steps[0]["bytes_embedding"] > 0 and steps[0]["bytes_dp"] == 0


def test_tp2_sequence_parallel_trains(tmp_path: Path, forking: dict[str, str]) -> None:
    runs = forked(2, *QUICK, "parallel=tp2", "parallel.sequence_parallel=true", "model=llama-tiny",
                  "model.hidden=64", "model.ffn_hidden=172", "model.n_layers=2", "train.steps=6", "train.eval_every=0",
                  f"logging.dir={tmp_path / 'run'}", cwd=tmp_path, env=forking)
    assert_trained(runs)
    steps, _ = read_metrics(tmp_path / "run")
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[0]["bytes_tp"] > 0 and steps[0]["bytes_dp"] == 0  # tp=2, dp=1
    assert "layout: world=2 = pp1 × dp1 × tp2" in output(runs)


def test_dp2_powersgd_compression_metrics(tmp_path: Path, forking: dict[str, str]) -> None:
    runs = forked(2, *QUICK, "parallel=dp", "compression=powersgd", "model.hidden=64", "model.n_layers=2",
                  "train.steps=5", "train.eval_every=0", "compression.measure_every=2",
                  "compression.warmup_steps=0",  # compressed from step 1: every step's bytes alike
                  f"logging.dir={tmp_path / 'run'}", cwd=tmp_path, env=forking)
    assert_trained(runs)
    steps, _ = read_metrics(tmp_path / "run")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    out = output(runs)
    assert "layout: world=2 = pp1 × dp2 × tp1" in out
    number, unit = re.search(r"model gpt-tiny: ([\d.]+)([KM]) parameters", out).groups()
    params = float(number) * {"K": 1e3, "M": 1e6}[unit]
    for s in steps:
        assert s["bytes_dp"] == steps[-1]["bytes_dp"] > 0  # the meter's all-reduce is not training traffic
        assert s["compression_ratio"] > 1, s  # rank-4 factors instead of fp32 gradients
        assert "bytes_dp_inter" not in s  # only under hierarchical
        metered = s["step"] in (2, 4, 5)  # every 2nd logged step (log_every=1) and the last
        assert ("compression_error" in s) == metered and ("bytes_meter" in s) == metered, s
        if metered:
            assert 0 < s["compression_error"] < 10, s
            assert s["bytes_meter"] == pytest.approx(4 * params, rel=0.01)  # one fp32 all-reduce of all gradients


def test_bad_layout_under_torchrun_is_one_line_per_rank(tmp_path: Path, env: dict[str, str]) -> None:
    """Under the real torchrun, 2 ranks of a tp2pp2 layout (4 ranks' worth): one line per rank naming the world
    torchrun gave it, and torchrun's failure summary names status 2."""
    r = torchrun(2, "parallel=tp2pp2", f"logging.dir={tmp_path / 'run'}", env=env, timeout=120)
    assert r.returncode != 0
    ours = [ln for ln in r.stderr.splitlines() if "hybrid: error:" in ln]
    assert sorted(ln.split()[0] for ln in ours) == ["[rank0]", "[rank1]"], r.stderr[-2000:]
    assert all(ln.split(maxsplit=1)[1].startswith("hybrid: error: ") for ln in ours), ours
    assert all("parallel.tp·parallel.pp = 2·2 = 4 does not divide world size 2" in ln for ln in ours), ours
    assert "Traceback" not in r.stderr.split("hybrid: error:")[0]  # no rank printed a traceback before it
    assert not (tmp_path / "run").exists()  # refused before the run's folder
    # torchrun's failure report: the first rank to exit left with status 2 (bad input); a peer still
    # shutting down when torchrun stopped the others may show SIGTERM instead
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)]
    root = r.stderr.split("Root Cause")[-1]
    assert int(re.search(r"exitcode\s*:\s*(-?\d+)", root).group(1)) == 2, r.stderr[-2000:]
    assert set(codes) <= {2, -15}, codes
