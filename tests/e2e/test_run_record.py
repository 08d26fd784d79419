"""What a run leaves in its folder, from the real entry point (`hybrid.train.main` as 2 ranks forked with
torchrun's environment and command line, test_rerun's `train_ranks`): train.log with rank 0's lines,
summary.json agreeing with metrics.jsonl, `.hydra/` — and a refused re-run that rewrites none of it."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from test_rerun import env as env  # noqa: F401  (the shared fixture)
from test_rerun import train, train_ranks
from test_torchrun import QUICK

RUN = [*QUICK, "model.hidden=64", "model.n_layers=2", "train.steps=4", "train.eval_every=2", "checkpoint.every=4",
       "checkpoint.resume=auto"]


def test_a_run_leaves_a_record_and_a_refused_rerun_keeps_it(tmp_path: Path, env: dict[str, str]) -> None:
    where = [f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    comm = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # recorded, unused by gloo
    ranks = train_ranks(tmp_path, {**env, **comm}, *RUN, *where)
    assert [r.code for r in ranks] == [0, 0], "".join(r.stderr[-3000:] for r in ranks)
    r, run = ranks[0], tmp_path / "run"
    log = (run / "train.log").read_text()
    lines = log.splitlines()
    assert lines[0].startswith("==== ") and lines[0].endswith(shlex.join([sys.executable, "-u", "-m", "hybrid.train",
                                                                          *RUN, *where]))  # the rank's command line
    assert "layout: world=2 = pp1 × dp2 × tp1" in log
    assert "communication: gloo; " in log and "NCCL_DEBUG=WARN TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in log
    assert "step 2: eval_loss" in log and "step 4: eval_loss" in log and "checkpoint: saved" in log
    assert lines[-1].startswith("done: 4 steps (to step 4) in ") and f"log {run / 'train.log'}" in lines[-1]
    assert all(line in r.stderr for line in lines[1:])  # the same lines as on the console

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["start_step"], summary["end_step"], summary["ended"]) == (0, 4, "completed")
    assert summary["final_loss"] == steps[-1]["loss"] and summary["first_loss"] == steps[0]["loss"]
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["mean_tokens_per_s"] == sum(r["tokens_per_s"] for r in steps[1:]) / len(steps[1:])
    assert len(summary["peak_memory_bytes"]) == 2 and min(summary["peak_memory_bytes"]) > 0
    assert [Path(p).name for p in summary["checkpoints"]] == ["step_0000004"]
    assert summary["communication"]["backend"] == "gloo" and summary["communication"]["nccl"] is None
    assert comm.items() <= summary["communication"]["settings"].items()
    assert "train.eval_every=2" in (run / ".hydra" / "overrides.yaml").read_text()

    kept = {name: (run / name).read_bytes() for name in (".hydra/config.yaml", ".hydra/overrides.yaml",
                                                         "train.log", "summary.json", "metrics.jsonl")}
    refused = train(tmp_path, env, *RUN, *where, "train.steps=6", "train.lr=0.01")  # one process: dp=1 is allowed
    assert refused.returncode == 2 and "was trained with other settings" in refused.stderr, refused.stderr[-3000:]
    assert {name: (run / name).read_bytes() for name in kept} == kept
