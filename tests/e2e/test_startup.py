"""hybrid.startup: the folder lock, the writability and free-space probes, the checkpoint size estimate,
where a wandb key is found, a failed write as one line; then the run's edge (`hybrid.train.run` under
`exit_on_error`, as `main` runs it, in this process): a second run on folders a forked holder holds, an
unwritable folder, a save failing while training (exit 1); and wandb online without a key on 2 ranks
(the same run body as 2 ranks forked with torchrun's environment, hybrid.testing.cli_runs: rank 0's answer
reaches every rank; tests/e2e/test_torchrun.py runs the real torchrun for a refusal on every rank). Each
refusal is one line (one per rank), exit status 2, no traceback, nothing written.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from test_nonfinite import entry, frozen_gc
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint import run_root
from hybrid.cli import exit_on_error
from hybrid.config import CONFIG_DIR, ConfigError, compose_config
from hybrid.model import analytic_param_count, build_model
from hybrid.startup import (
    EXTRA_BYTES,
    LOCK_FILE,
    check_wandb,
    checkpoint_bytes,
    hold_run_folders,
    lock_folder,
    wandb_key_source,
    write_fault,
)
from hybrid.testing.cli_runs import run_forked_ranks

B = ["model=gpt-tiny", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
     "logging.wandb.mode=disabled", "logging.progress=false"]


def _hold(folder: str, ready: Any, done: Any) -> None:
    lock_folder(Path(folder), "logging.dir", "logging.dir")
    ready.set()
    done.wait(60)


def forked_holder(folder: Path) -> tuple[Any, Any]:
    """A forked process holding `folder`'s lock until its `done` event is set (or it is killed)."""
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(folder), ready, done), daemon=True)
    proc.start()
    assert ready.wait(30)
    return proc, done


def read_only(folder: Path) -> Path:
    """`folder`, created and made read-only; skips the test where that does not stop writes (root)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except PermissionError:
        return folder
    pytest.skip("this user can write into a read-only folder (root)")


def test_a_held_folder_names_its_holder_and_a_killed_holder_blocks_nobody(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "a"
    proc, _ = forked_holder(folder)
    with pytest.raises(ConfigError) as e:
        lock_folder(folder, "logging.dir", "logging.dir (or run_name)")
    assert str(e.value).startswith(f"logging.dir {folder} is in use by another run (pid {proc.pid} on "
                                   f"{socket.gethostname()}, started ")
    assert " ".join(sys.argv[1:]) in str(e.value)  # the holder's command line (the fork's: pytest's)
    os.kill(proc.pid, signal.SIGKILL)  # the kernel drops its lock; its lock file stays, stale
    proc.join(10)
    assert (folder / LOCK_FILE).read_text().startswith("{")
    lock = lock_folder(folder, "logging.dir", "logging.dir")
    lock.release()
    assert not (folder / LOCK_FILE).exists() and folder.is_dir()  # the folder was the holder's: kept


def test_released_and_refused_folders_leave_nothing_behind(tmp_path: Path) -> None:
    lock = lock_folder(tmp_path / "new" / "run", "logging.dir", "logging.dir")
    assert (tmp_path / "new" / "run" / LOCK_FILE).is_file()
    lock.release()
    assert list(tmp_path.iterdir()) == []  # the folders it created, empty again, are gone
    ro = read_only(tmp_path / "ro")
    with pytest.raises(ConfigError, match=f"logging.dir {ro / 'run'} cannot be created: Permission denied"):
        lock_folder(ro / "run", "logging.dir", "logging.dir")
    with pytest.raises(ConfigError, match=f"logging.dir {ro} is not writable: Permission denied"):
        lock_folder(ro, "logging.dir", "logging.dir")
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("unwritable", ["logging.dir", "checkpoint.dir"])
def test_an_unwritable_folder_is_refused_before_a_step(unwritable: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """`hybrid.train.run` as `main` runs it: a logging.dir that cannot be created (its parent is read-only),
    or a read-only checkpoint.dir, is one line and exit 2 before anything is trained or written."""
    ro = read_only(tmp_path / "ro")
    folders = {"logging.dir": tmp_path / "run", "checkpoint.dir": tmp_path / "ck"}
    folders[unwritable] = ro / "run" if unwritable == "logging.dir" else ro
    overrides = ["train.steps=2", "checkpoint.every=1", *(f"{k}={v}" for k, v in folders.items())]
    code, lines = main_run(overrides, capsys)
    run_name = compose_config(B).run_name
    named = {"logging.dir": f"logging.dir {ro / 'run'}", "checkpoint.dir": f"checkpoint folder {ro / run_name}"}
    assert (code, lines) == (2, [f"hybrid: error: {named[unwritable]} cannot be created: Permission denied"])
    assert sorted(tmp_path.iterdir()) == [ro] and list(ro.iterdir()) == []  # nothing trained or written


def test_hydra_makes_no_run_folder() -> None:
    """A single run's folder is made by hybrid.startup (one line when it cannot be), not by Hydra before the
    run starts (a traceback): Hydra's run dir is the working directory."""
    assert OmegaConf.load(Path(CONFIG_DIR) / "config.yaml").hydra.run.dir == "."


def test_too_little_free_space_for_one_checkpoint_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    n = analytic_param_count(compose_config(B).model, 300)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=checkpoint_bytes(n) - 1))
    cfg = compose_config([*B, f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    with pytest.raises(ConfigError, match=f"checkpoint folder {tmp_path / 'ck' / cfg.run_name} has .* free, "
                                          f"less than one checkpoint .* for {n:,} parameters"):
        hold_run_folders(cfg, n, True)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=checkpoint_bytes(n)))
    with hold_run_folders(cfg, n, True):
        assert (tmp_path / "ck" / cfg.run_name / LOCK_FILE).is_file()
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_bytes_is_the_fp32_weights_and_adamw_moments(model_config: Any) -> None:
    cfg = model_config("gpt-tiny")
    model = build_model(cfg, 300)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 300, (1, 8))).float().sum().backward()
    opt.step()
    params = list(model.parameters())
    moments = [t for s in opt.state.values() for t in s.values() if t.numel() > 1]
    assert len(moments) == 2 * len(params)
    n = sum(p.numel() for p in params)
    assert n == analytic_param_count(cfg, 300)
    stored = sum(t.numel() * t.element_size() for t in params + moments)
    assert checkpoint_bytes(n) == stored + EXTRA_BYTES


def test_wandb_missing_is_one_line_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    for mode in ("offline", "online"):
        with pytest.raises(ConfigError, match=f"logging.wandb.mode={mode} needs the wandb package") as e:
            check_wandb(mode, {"WANDB_API_KEY": "k" * 40}, tmp_path)
        assert "\n" not in str(e.value)
    check_wandb("disabled", {}, tmp_path)  # no wandb needed


def test_wandb_key_sources_are_found_offline(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    assert wandb_key_source({}, home) is None
    assert wandb_key_source({"WANDB_API_KEY": "k" * 40}, home) == "WANDB_API_KEY"
    assert wandb_key_source({"WANDB_IDENTITY_TOKEN_FILE": "/tok"}, home) == "WANDB_IDENTITY_TOKEN_FILE"
    (home / ".netrc").write_text("machine example.org login user password k\n")
    assert wandb_key_source({}, home) is None  # an entry for another host
    assert wandb_key_source({"WANDB_BASE_URL": "https://example.org"}, home) == "netrc"
    (home / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    assert wandb_key_source({}, home) == "netrc"
    assert wandb_key_source({"NETRC": str(tmp_path / "none")}, home) is None  # NETRC wins over ~/.netrc
    settings = tmp_path / "wandb-config"
    settings.mkdir()
    (settings / "settings").write_text("[default]\napi_key = kkk\n")
    assert wandb_key_source({"NETRC": str(tmp_path / "none"), "WANDB_CONFIG_DIR": str(settings)}, home) == (
        "wandb settings")


def test_a_failed_write_while_training_is_one_line() -> None:
    full = OSError(28, "No space left on device")
    dcp_error = CheckpointException("save", {0: (ValueError("x"), None), 1: (full, None)})
    assert write_fault(dcp_error, 4) == ("writing the run's files failed after step 4 (rank 1): [Errno 28] No space "
                                         "left on device; free space or fix the folder's permissions, then resume "
                                         "with checkpoint.resume=auto")
    try:
        raise RuntimeError("checkpoint save to x failed") from CheckpointException("save", {0: (full, None)})
    except RuntimeError as e:  # Checkpointer.wait's, around an async save's failure
        assert write_fault(e, 2) is not None and "(rank 0): [Errno 28]" in (write_fault(e, 2) or "")
    assert write_fault(PermissionError(13, "Permission denied", "/x/metrics.jsonl"), 1) is not None
    assert write_fault(CheckpointException("save", {0: (ValueError("x"), None)}), 1) is None  # a bug: raised
    assert write_fault(RuntimeError("boom"), 1) is None
    assert write_fault(FileNotFoundError(2, "No such file or directory"), 1) is None  # not a write the disk refused


def main_run(overrides: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    """`hybrid.train.run` in this process, as `main` runs it: (exit status, the error lines)."""
    from hybrid.train import RUN_ERRORS, run

    cfg = compose_config([*B, *overrides])
    with pytest.raises(SystemExit) as e:
        exit_on_error(lambda: run(cfg), RUN_ERRORS)
    return int(e.value.code or 0), [ln for ln in capsys.readouterr().err.splitlines() if "hybrid: error:" in ln]


def files(*roots: Path) -> dict[str, bytes]:
    return {str(f): f.read_bytes() for root in roots for f in sorted(root.rglob("*")) if f.is_file()}


def test_a_second_run_on_held_folders_is_refused_naming_the_holder(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    folders = [f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    run_dir, ck = tmp_path / "run", run_root(compose_config([*B, *folders]))
    (ck / "step_0000002").mkdir(parents=True)
    (ck / "step_0000002" / "__0_0.distcp").write_bytes(bytes(range(256)))
    proc, done = forked_holder(run_dir)  # the first run, holding its run folder through hybrid.startup
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    before = files(run_dir, ck)
    try:
        code, lines = main_run([*folders, "train.steps=2", "checkpoint.resume=auto"], capsys)
    finally:
        done.set()
        proc.join(10)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"hybrid: error: logging.dir {run_dir} is in use by another run (pid {proc.pid} on "
                               f"{socket.gethostname()}, started ")
    assert lines[0].endswith(f"{' '.join(sys.argv[1:])}); wait for it to end, or give this run its own logging.dir "
                             "(or run_name)")  # the holder's command line (the fork's: pytest's)
    assert files(run_dir, ck) == before


def test_a_save_that_fails_while_training_is_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp

    def disk_full(*_: Any, **__: Any) -> None:
        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", disk_full)
    code, lines = main_run([f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}", "train.steps=2",
                            "checkpoint.every=1"], capsys)
    assert (code, lines) == (1, ["hybrid: error: writing the run's files failed after step 1 (rank 0): [Errno 28] "
                                 "No space left on device; free space or fix the folder's permissions, then resume "
                                 "with checkpoint.resume=auto"])


def test_wandb_online_without_a_key_is_one_line_on_every_rank(tmp_path: Path, e2e_cache: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (forked, torchrun's environment): rank 0 finds no key and every rank prints its answer."""
    for name in [k for k in os.environ if k.startswith("WANDB_") or k == "NETRC"]:
        monkeypatch.delenv(name)  # the ranks inherit this environment: no key from it
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no netrc, no wandb settings
    argv = [*B, "train.steps=2", "logging.wandb.mode=online", f"logging.dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ck'}"]
    with frozen_gc():
        runs = run_forked_ranks(entry(compose_config(argv)), argv, tmp_path, 2,
                                {"OMP_NUM_THREADS": "1", "HYBRID_CACHE": e2e_cache}, timeout_s=120)
    lines = [r.error_lines() for r in runs]
    assert [r.code for r in runs] == [2, 2] and [len(ln) for ln in lines] == [1, 1], [r.stderr[-3000:] for r in runs]
    assert [ln[0].split(" ", 1)[0] for ln in lines] == ["[rank0]", "[rank1]"]
    assert lines[0][0].split(" ", 1)[1] == lines[1][0].split(" ", 1)[1]
    needs = "a wandb API key" if importlib.util.find_spec("wandb") else "the wandb package"  # none: the package first
    assert f"logging.wandb.mode=online needs {needs}" in lines[0][0]
    assert all("Connection closed" not in r.stderr and "Traceback" not in r.stderr for r in runs)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()
