"""The real command line: torchrun -m hybrid.train, launch/multinode.sh emulating 2 nodes, bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["model=gpt-tiny", "data.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=4",
         "train.lr=3e-3", "optim.warmup_steps=2", "train.eval_every=4", "train.eval_batches=1",
         "logging.wandb.mode=disabled", "logging.progress=false"]
# the shared uninterrupted run (conftest's tiny_reference) and the fault-tolerance runs compared with it; dropout
# on: a resume is bit-exact only if every rank's RNG streams come back too
TINY = [*QUICK, "model.hidden=64", "model.n_layers=2", "model.dropout=0.1", "train.steps=8", "checkpoint.every=2",
        "checkpoint.keep=2"]


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


def test_torchrun_two_ranks_loss_falls(tiny_reference: Any) -> None:
    """The shared uninterrupted run (conftest's tiny_reference: torchrun, 2 ranks, TINY) trains and logs."""
    steps, evals, tmp = tiny_reference.steps, tiny_reference.evals, tiny_reference.tmp / "run"
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert len(evals) == 2 and evals[-1]["eval_loss"] < steps[0]["loss"]
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "bytes_dp"):
        assert key in steps[0]
    assert steps[0]["bytes_dp"] > 0  # gradients were all-reduced over dp=2
    assert "layout: world=2 = pp1 × dp2 × tp1" in tiny_reference.out
    assert (tmp / ".hydra" / "config.yaml").exists()


def test_emulated_two_nodes_with_multinode_sh(tmp_path: Path, env: dict[str, str]) -> None:
    port = str(29400 + os.getpid() % 500)
    args = ["--nnodes", "2", "--nproc", "1", "--endpoint", f"127.0.0.1:{port}", "--run-id", f"e2e{os.getpid()}",
            "--max-restarts", "0", *QUICK, "train.steps=6", f"logging.dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'ck'}"]  # multinode.sh adds checkpoint.resume=auto: nothing stale there
    procs = [subprocess.Popen(["bash", str(ROOT / "launch" / "multinode.sh"), "--node-rank", str(n), *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "2 node(s) × 1 ranks" in "".join(outs)
    steps, _ = read_metrics(tmp_path)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_bad_layout_under_torchrun_is_one_line_per_rank(tmp_path: Path, env: dict[str, str]) -> None:
    r = torchrun(2, "parallel=tp2pp2", f"logging.dir={tmp_path}", env=env, timeout=120)
    assert r.returncode != 0
    ours = [ln for ln in r.stderr.splitlines() if "hybrid: error:" in ln]
    assert sorted(ln.split()[0] for ln in ours) == ["[rank0]", "[rank1]"]
    assert all("does not divide world size 2" in ln for ln in ours)
    assert "Traceback" not in r.stderr.split("hybrid: error:")[0]  # no rank printed a traceback before it


def test_torchrun_tp2_sequence_parallel_trains(tmp_path: Path, env: dict[str, str]) -> None:
    r = torchrun(2, *QUICK, "parallel=tp2", "parallel.sequence_parallel=true", "model=llama-tiny", "train.steps=6",
                 "train.eval_every=0", f"logging.dir={tmp_path}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, _ = read_metrics(tmp_path)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[0]["bytes_tp"] > 0 and steps[0]["bytes_dp"] == 0  # tp=2, dp=1
    assert "layout: world=2 = pp1 × dp1 × tp2" in r.stdout + r.stderr


def test_torchrun_pipeline_interleaved_trains(tmp_path: Path, env: dict[str, str]) -> None:
    r = torchrun(2, *QUICK, "parallel=pp2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                 "train.steps=6", f"logging.dir={tmp_path}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, evals = read_metrics(tmp_path)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3  # the last stage's loss reached rank 0's log
    assert evals and evals[-1]["eval_loss"] < steps[0]["loss"]
    assert steps[0]["bytes_pp"] > 0 and steps[0]["bytes_embedding"] > 0 and steps[0]["bytes_dp"] == 0
    out = r.stdout + r.stderr
    assert "layout: world=2 = pp2 × dp1 × tp1" in out
    assert "pipeline: schedule interleaved, pp=2 × 2 chunk(s), 4 microbatches, layers per part [1, 1, 1, 1]" in out


def test_torchrun_dp4_powersgd_compression_metrics(tmp_path: Path, env: dict[str, str]) -> None:
    r = torchrun(4, *QUICK, "parallel=dp", "compression=powersgd", "train.steps=5", "train.eval_every=0",
                 "compression.measure_every=2", f"logging.dir={tmp_path}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, _ = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert "layout: world=4 = pp1 × dp4 × tp1" in r.stdout + r.stderr
    params = 1e6 * float(re.search(r"model gpt-tiny: ([\d.]+)M parameters", r.stdout + r.stderr).group(1))
    for s in steps:
        assert s["bytes_dp"] == steps[-1]["bytes_dp"] > 0  # the meter's all-reduce is not training traffic
        assert s["compression_ratio"] > 1, s  # rank-4 factors instead of fp32 gradients
        assert "bytes_dp_inter" not in s  # only under hierarchical
        metered = s["step"] in (2, 4, 5)  # every 2nd logged step (log_every=1) and the last
        assert ("compression_error" in s) == metered and ("bytes_meter" in s) == metered, s
        if metered:
            assert 0 < s["compression_error"] < 10, s
            assert s["bytes_meter"] == pytest.approx(4 * params, rel=0.01)  # one fp32 all-reduce of all gradients


@pytest.mark.parametrize("overrides,needle", [
    (["compression=nonexistent"], "Could not find 'compression/nonexistent'"),
    # the other checks made before the process group exists take validate's path, as hierarchical's: their
    # lines per rank are checked by forked ranks in tests/e2e/test_bad_inputs.py
    (["compression=hierarchical"], "compression=hierarchical needs compression.inner set to one of"),
])
def test_bad_compression_config_is_one_line_per_rank(overrides: list[str], needle: str, tmp_path: Path,
                                                     env: dict[str, str]) -> None:
    r = torchrun(2, *overrides, f"logging.dir={tmp_path}", env=env, timeout=120)
    assert r.returncode != 0
    ours = [ln for ln in r.stderr.splitlines() if "hybrid: error:" in ln]
    assert sorted(ln.split()[0] for ln in ours) == ["[rank0]", "[rank1]"], r.stderr[-2000:]
    assert all(needle in ln for ln in ours), ours
    assert "Traceback" not in r.stderr.split("hybrid: error:")[0]
    # torchrun's failure report: the first rank to exit left with status 2 (bad input); a peer still
    # shutting down when torchrun stopped the others may show SIGTERM instead
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)]
    root = r.stderr.split("Root Cause")[-1]
    assert int(re.search(r"exitcode\s*:\s*(-?\d+)", root).group(1)) == 2, r.stderr[-2000:]
    assert set(codes) <= {2, -15}, codes
