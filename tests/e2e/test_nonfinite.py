"""`train.on_nonfinite`: a gradient that is not finite never trains the model, and every rank does the same.

Each run is `hybrid.train`'s run as `main` runs it (train.log's RunLog, `run` under `exit_on_error` with
RUN_ERRORS, the clean shutdown) as 2 ranks forked from the test process (`hybrid.testing.cli_runs.
run_forked_ranks`: torchrun's environment, gloo over a local port, each rank's exit status and output
apart), on a config composed once in the test process (`compose_config`'s memo: the ranks inherit it
instead of composing it three times each; what is tested here comes after composition). The model is
gpt-tiny at width 64 with 2 layers. The fault: on ONE rank, at the start of step k, a hook on that rank's
first parameter adds inf to its gradient for that step (`inject`; once per process, so a rewound run does
not meet it again). The references:

- stop (pp2, the parameter on stage 1 only): every rank exits 1 with the same one line naming step k,
  the loss and the parameter the injection recorded; no traceback; metrics.jsonl ends at step k − 1.
- skip (dp2, injected before the DP sync as a real overflow would be): the checkpoint of step k holds
  exactly the tensors of step k − 1 (weights and Adam moments, read back with DCP's own reader), step k + 1
  moves them again; the losses before k are the uninterrupted run's, the LRs are the uninterrupted run's
  with the schedule held back one step from k + 1 on (Megatron's skipped iteration), `skipped_steps` counts.
- skip under compression=sign (dp2): the error-feedback residuals the bad gradient spoilt start afresh, so
  only the injected step is skipped.
- 1-bit Adam after its warm-up (dp2, replicas on their own gradients): both ranks skip rank 1's bad step.
- stop under `sync=diloco`, `gossip`, `ps` (dp2, replicas on their own gradients): both ranks stop with
  rank 1's line.
- rewind (dp2): the run reloads step c < k, keeps the data position past step k and finishes; its losses
  after the rewind equal, bit for bit, a fresh run resumed from a copy of checkpoint c whose manifest holds
  that data position (the resume path as the reference of the in-place rewind); before k, the
  uninterrupted run's. Before the first checkpoint, rewind stops with one line saying so.
Bit-for-bit: the same layout, seed and data give identical floats (tests/dist/test_checkpoint.py).
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hybrid.checkpoint import MANIFEST, step_path
from hybrid.checkpoint.state import named_parameters
from hybrid.cli import env_int, exit_on_error
from hybrid.config import Config, compose_config
from hybrid.record.runlog import RunLog, command_line
from hybrid.testing.cli_runs import CliRun, run_forked_ranks
from hybrid.train import RUN_ERRORS
from hybrid.train import _shutdown as shutdown
from hybrid.train import run as train_run

B = ["model=gpt-tiny", "model.n_layers=2", "model.hidden=64", "data.seq_len=64", "train.global_batch_size=8",
     "train.micro_batch_size=4", "logging.wandb.mode=disabled", "logging.progress=false", "train.eval_every=0",
     "optim.warmup_steps=2", "logging.traffic_map=false", "run_name=nf", "logging.log_every=1"]
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
TIMEOUT_S = 120


def load_what_runs_load() -> None:
    """Load here, once, what every run would load (transformers' tokenizer classes, AdamW's kernels, the
    trainer's and the data's modules, numpy.ma for the sampler): runs forked from this process inherit them
    instead of importing them again (about a second per run)."""
    import numpy.ma  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    import hybrid.data  # noqa: F401
    import hybrid.memory  # noqa: F401
    import hybrid.trainer  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    load_what_runs_load()


@contextmanager
def frozen_gc() -> Iterator[None]:
    """This process's objects out of the collector's sight while ranks are forked: a rank's collection (the
    clean shutdown collects) scans only its own objects, instead of touching, and so copying, every page of
    the inherited heap."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def entry(cfg: Config) -> Callable[[], None]:
    """What `hybrid.train.main` runs once Hydra has composed `cfg`: rank 0's RunLog, `run` with RUN_ERRORS
    turned into one line and an exit status (hybrid.cli), the clean shutdown."""
    def main() -> None:
        with RunLog(env_int("RANK", 0) == 0, command_line()) as log:
            exit_on_error(lambda: train_run(cfg, log), RUN_ERRORS)
        shutdown()
    return main


def inject(step: int, rank: int, record: Path) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """A wrapper of a rank's main that adds an inf to the gradient of rank `rank`'s first parameter during
    step `step` (the first time that step runs); the parameter's global name is written to `record`."""
    def wrap(main: Callable[[], None]) -> Callable[[], None]:
        def injected() -> None:
            from hybrid.trainer import Trainer

            original, fired = Trainer.train_step, []

            def train_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
                if self.step != step - 1 or self.ctx.rank != rank or fired:
                    return original(self, *args, **kwargs)
                fired.append(True)
                name, p = next(iter(named_parameters(self.model, False)))
                record.write_text(name)
                handle = p.register_hook(lambda g: g + math.inf)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    handle.remove()

            Trainer.train_step = train_step  # type: ignore[method-assign]
            main()
        return injected
    return wrap


def run(tmp: Path, name: str, extra: list[str],
        fault: Callable[[Callable[[], None]], Callable[[], None]] = lambda main: main) -> list[CliRun]:
    """One 2-rank run in `tmp/name` (its own run and checkpoint folders), `fault` wrapped around its main."""
    folder = tmp / name
    folder.mkdir()
    argv = [*B, f"logging.dir={folder / 'run'}", f"checkpoint.dir={folder / 'ck'}", *extra]
    main = fault(entry(compose_config(argv)))
    with frozen_gc():
        return run_forked_ranks(main, argv, folder, 2, ENV, timeout_s=TIMEOUT_S)


def records(tmp: Path, name: str) -> list[dict[str, Any]]:
    lines = (tmp / name / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def tensors(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights, Adam moments), read with DCP's own reader."""
    out = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def assert_ok(runs: list[CliRun]) -> None:
    for r in runs:
        assert r.code == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted dp2 run of 6 steps: its metrics records."""
    tmp = tmp_path_factory.mktemp("reference")
    assert_ok(run(tmp, "ref", ["parallel=dp", "train.steps=6"]))
    return records(tmp, "ref")


def test_stop_names_the_step_on_every_rank(tmp_path: Path) -> None:
    record = tmp_path / "injected"
    runs = run(tmp_path, "stop", ["parallel=pp2", "train.steps=6"], inject(3, 1, record))
    for rank, r in enumerate(runs):
        assert r.code == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert len(r.error_lines()) == 1, r.stderr[-3000:]
        line = r.error_lines()[0]
        assert line.startswith(f"[rank{rank}] hybrid: error: step 3: ") and "(train.on_nonfinite=stop;" in line
        assert f"first non-finite gradient: {record.read_text()} (rank 1)" in line and "loss " in line
    assert runs[0].error_lines()[0].partition("]")[2] == runs[1].error_lines()[0].partition("]")[2]
    assert [r["step"] for r in records(tmp_path, "stop")] == [1, 2]


@pytest.mark.parametrize("mode", [["sync=diloco", "sync.inner_steps=2"], ["sync=gossip"], ["sync=ps"]],
                         ids=["diloco", "gossip", "ps"])
def test_stop_under_replica_sync_modes_reaches_every_replica(tmp_path: Path, mode: list[str]) -> None:
    """dp2 replicas on their own gradients (DiLoCo, gossip, the parameter server): rank 1's bad step stops rank 0
    too, with the same line, instead of leaving it waiting at the next exchange."""
    runs = run(tmp_path, "stop", ["parallel=dp", "train.steps=6", *mode], inject(3, 1, tmp_path / "injected"))
    for rank, r in enumerate(runs):
        assert r.code == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert len(r.error_lines()) == 1 and r.error_lines()[0].startswith(f"[rank{rank}] hybrid: error: step 3: ")
    assert runs[0].error_lines()[0].partition("]")[2] == runs[1].error_lines()[0].partition("]")[2]


def test_skip_leaves_weights_and_moments_unchanged(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    runs = run(tmp_path, "skip", ["parallel=dp", "train.steps=6", "train.on_nonfinite=skip", "checkpoint.every=1",
                                  "checkpoint.keep=0"], inject(3, 1, tmp_path / "injected"))
    assert_ok(runs)
    assert "warning: step 3: the gradient is not finite" in runs[0].stderr and "skipped (1 in a row" in runs[0].stderr
    got = records(tmp_path, "skip")
    assert [r["loss"] for r in got[:2]] == [r["loss"] for r in reference[:2]]
    assert [r["lr"] for r in got] == [r["lr"] for r in reference[:3]] + [r["lr"] for r in reference[2:5]]
    assert [r["skipped_steps"] for r in got] == [0, 0, 1, 1, 1, 1]
    root = tmp_path / "skip" / "ck" / "nf"
    before, at, after = (tensors(step_path(root, s), tmp_path) for s in (2, 3, 4))
    assert before.keys() == at.keys() and len(before) > 0
    for key in before:
        assert torch.equal(before[key], at[key]), key  # step 3 updated nothing
    assert any(not torch.equal(at[k], after[k]) for k in at)  # step 4 trained again


def test_skip_under_error_feedback_trains_on(tmp_path: Path) -> None:
    """compression=sign keeps an error-feedback residual per bucket, which the bad gradient fills with NaN: the
    skip drops those entries (the hook starts them afresh), so only the injected step is skipped."""
    args = ["parallel=dp", "train.steps=5", "train.on_nonfinite=skip", "compression=sign"]
    assert_ok(run(tmp_path, "sign", args, inject(3, 1, tmp_path / "injected")))
    got = records(tmp_path, "sign")
    assert [r["skipped_steps"] for r in got] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(r["grad_norm"]) for r in got[3:]), got


def test_replicas_with_their_own_gradients_agree(tmp_path: Path) -> None:
    """1-bit Adam after its warm-up: each DP replica steps on its own gradient, so only rank 1's is not finite;
    both must skip the step (without the 4-byte DP agreement rank 0 would step and the ranks would hang)."""
    args = ["parallel=dp", "train.steps=5", "train.on_nonfinite=skip", "compression=onebit_adam",
            "compression.warmup_steps=2"]
    runs = run(tmp_path, "onebit", args, inject(4, 1, tmp_path / "injected"))
    assert_ok(runs)
    assert f"first non-finite gradient: {(tmp_path / 'injected').read_text()} (rank 1)" in runs[0].stderr
    assert [r["skipped_steps"] for r in records(tmp_path, "onebit")] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("zero", [0, 3], ids=["plain", "zero3"])
def test_rewind_reloads_the_checkpoint_and_skips_the_bad_batch(tmp_path: Path, reference: list[dict[str, Any]],
                                                               zero: int) -> None:
    """Also under ZeRO-3, whose load gathers the sharded parameters and takes the shards back."""
    args = ["parallel=dp", "train.steps=6", f"parallel.zero={zero}", "train.on_nonfinite=rewind", "checkpoint.every=2",
            "checkpoint.keep=0"]
    runs = run(tmp_path, "rewind", args, inject(5, 0, tmp_path / "injected"))
    assert_ok(runs)
    root = tmp_path / "rewind" / "ck" / "nf"
    assert f"rewound to step 4 ({step_path(root, 4)}), the batches of steps 5-5 skipped" in runs[0].stderr
    got = records(tmp_path, "rewind")
    if zero == 0:
        assert [r["loss"] for r in got[:4]] == [r["loss"] for r in reference[:4]]
    # the reference of the rewind: checkpoint 4 resumed by a fresh run, its data position past step 5's batch
    copy = tmp_path / "copy" / "step_0000004"
    shutil.copytree(step_path(root, 4), copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["consumed_samples"] += manifest["consumed_samples"] // manifest["step"]  # one global batch more
    (copy / MANIFEST).write_text(json.dumps(manifest))
    assert_ok(run(tmp_path, "resumed", [*args[:3], f"checkpoint.resume={copy}"]))
    resumed = records(tmp_path, "resumed")
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in got[-2:]] == [r["loss"] for r in resumed]
    assert [r["step"] for r in got[-2:]] == [5, 6]


def test_rewind_without_a_checkpoint_stops_with_one_line(tmp_path: Path) -> None:
    runs = run(tmp_path, "none", ["parallel=dp", "train.steps=4", "train.on_nonfinite=rewind", "checkpoint.every=3"],
               inject(2, 1, tmp_path / "injected"))  # the first checkpoint would be step 3's
    for r in runs:
        assert r.code == 1 and "Traceback" not in r.stderr and len(r.error_lines()) == 1, r.stderr[-3000:]
        assert "step 2: " in r.error_lines()[0] and "has no checkpoint of this run to rewind to" in r.error_lines()[0]
