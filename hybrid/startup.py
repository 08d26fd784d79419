"""Start-up: the checks only rank 0 can make (its folders, its wandb key), decided once and shared with
every rank before anything of the run is written; and a write that fails while training, as one line.

- The lock (docs/runs.md, "Locking"): rank 0 holds an exclusive advisory lock on `<logging.dir>/.hybrid.lock`
  and, when the run saves checkpoints (`saves_checkpoints`), on `<checkpoint.dir>/<run_name>/.hybrid.lock`,
  for the run's lifetime. It is a POSIX record lock (`fcntl.lockf`): the kind NFS carries between hosts
  (its lock service), not inherited by forked children, and dropped by the kernel when the process dies,
  so a restart or a resume after a kill is never locked out. The holder writes its pid, host, start time
  and command line into the file; a second run reads them and is refused with one line naming the holder.
  At the end the holder removes the file while still holding it (a run that opened the old file sees it
  gone and takes the new one) and the folders it created that are still empty, so a refused run, or one
  with nothing to do, leaves nothing behind; a file left by a killed run holds no lock and blocks nobody.
- Writability: a locked folder is created at start-up when missing, not once the run is accepted, because
  the lock lives in it and two new runs must meet on one file; a probe file is created and removed there,
  and the checkpoint folder's free space must hold one checkpoint (`checkpoint_bytes`).
- wandb: `logging.wandb.mode=online` needs an API key where wandb looks for one (`wandb_key_source`),
  found without contacting the network. A single process (no rank to share the answer with) checks it
  before its data step too (`check_wandb_key` in `hybrid.train.run`): refused at once, not after the
  tokenizer and the token cache were built.

Collective: `hold_run_folders` is one broadcast_object_list over the world (rank 0's answer: None or the
error line), as `hybrid.checkpoint.plan_resume`, so every rank raises the same ConfigError.
"""

from __future__ import annotations

import configparser
import contextlib
import errno
import fcntl
import importlib.util
import json
import netrc
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

import torch.distributed as dist

from hybrid.checkpoint import run_root
from hybrid.cli import warn
from hybrid.config import ConfigError
from hybrid.record.metrics import format_bytes
from hybrid.record.runlog import command_line
from hybrid.record.wandb_run import WandbSettings

if TYPE_CHECKING:
    from hybrid.config import Config

LOCK_FILE = ".hybrid.lock"
EXTRA_BYTES = 16 << 20
"""A checkpoint's small extras: manifest, RNG and hook states, the tokenizer's files."""
_TRIES = 10  # lock files replaced under us (each by a holder that ended) before giving up
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS})
"""The OSErrors of a write the run cannot go on from (space, quota, permissions); others are bugs: raised."""


class WriteFault(Exception):
    """A write of the run's files failed while training (full disk, permissions): one line, exit status 1."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file by the holder, read by a run it keeps out."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def me(cls) -> Holder:
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), stamp, command_line())

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def _holder_of(fd: int) -> str:
    """The holder described from the lock file open at `fd`, or why it cannot be."""
    try:
        return Holder(**json.loads(os.pread(fd, 1 << 16, 0))).describe()
    except (OSError, ValueError, TypeError):
        return "holder unknown: it has not written its lock file yet"


class FolderLock:
    """`folder`'s lock file open at `fd` and locked (None: the file system keeps no locks), and the folders
    created for it, deepest first."""

    def __init__(self, folder: Path, fd: Optional[int], created: list[Path]) -> None:
        self.folder, self.fd, self.created = folder, fd, created

    def release(self) -> None:
        """Remove the lock file (still held), drop the lock, and remove the created folders still empty."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                (self.folder / LOCK_FILE).unlink()
            os.close(self.fd)
            self.fd = None
        for folder in self.created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty folder
        self.created = []


def _make(folder: Path, what: str) -> list[Path]:
    """Create `folder` and its missing parents; returns the ones created, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.is_dir()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        FolderLock(folder, None, missing).release()
        raise ConfigError(f"{what} {folder} cannot be created: {e.strerror or e}") from None
    return missing


def _probe(folder: Path, what: str) -> None:
    """Create and remove a file in `folder`: ConfigError if that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".hybrid-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(f"{what} {folder} is not writable: {e.strerror or e}") from None


def _lock_file(folder: Path, what: str, key: str) -> Optional[int]:
    """Open and lock `folder`/LOCK_FILE (retrying when a holder that ended removed it after we opened it),
    then write this process into it. ConfigError naming the holder when another run holds it; None, after
    a warning, when the file system keeps no locks."""
    path = folder / LOCK_FILE
    for _ in range(_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{what} {folder}: its lock file {LOCK_FILE} cannot be opened: {e.strerror}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder_of(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise ConfigError(f"{what} {folder} is in use by another run ({holder}); wait for it to end, "
                                  f"or give this run its own {key}") from None
            warn(f"warning: {what} {folder} cannot be locked ({e.strerror}): another run could share it unnoticed")
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(asdict(Holder.me())).encode(), 0)
                return fd
        os.close(fd)
    raise ConfigError(f"{what} {folder}: its lock file {path} kept being replaced; is another run starting there?")


def lock_folder(folder: Path, what: str, key: str) -> FolderLock:
    """Create `folder` if missing, check that a file can be made in it, and lock it (`_lock_file`); on
    any refusal the folders created are removed again. `what` names the folder, `key` the setting to change."""
    created = _make(folder, what)
    try:
        _probe(folder, what)
        return FolderLock(folder, _lock_file(folder, what, key), created)
    except BaseException:
        FolderLock(folder, None, created).release()
        raise


def checkpoint_bytes(n_params: int) -> int:
    """The bytes of one checkpoint of `n_params` parameters, estimated as 12·N + EXTRA_BYTES: 4 bytes per
    parameter for the fp32 weights and 8 for AdamW's two fp32 moments (exp_avg, exp_avg_sq), plus the
    small extras (manifest, RNG and hook states, the tokenizer's files)."""
    return 12 * n_params + EXTRA_BYTES


def check_space(folder: Path, n_params: int) -> None:
    """ConfigError unless the file system of `folder` has room for one checkpoint (`checkpoint_bytes`)."""
    free, need = shutil.disk_usage(folder).free, checkpoint_bytes(n_params)
    if free < need:
        raise ConfigError(f"checkpoint folder {folder} has {format_bytes(free)} free, less than one checkpoint "
                          f"(~{format_bytes(need)} for {n_params:,} parameters: 12 bytes each + extras); "
                          "free some space or set checkpoint.dir elsewhere")


def saves_checkpoints(cfg: Config) -> bool:
    """Whether the run may write checkpoints: every `checkpoint.every` steps or on a signal."""
    c = cfg.checkpoint
    return c.every > 0 or bool(list(getattr(c, "save_on_signal", ())))


def _wandb_settings_file(env: Mapping[str, str], home: Path) -> configparser.ConfigParser:
    """wandb's own settings file ($WANDB_CONFIG_DIR/settings, else ~/.config/wandb/settings), if readable."""
    parser = configparser.ConfigParser()
    folder = Path(env["WANDB_CONFIG_DIR"]) if env.get("WANDB_CONFIG_DIR") else home / ".config" / "wandb"
    with contextlib.suppress(OSError, configparser.Error):
        parser.read(folder / "settings", encoding="utf-8")
    return parser


def _netrc_has(env: Mapping[str, str], home: Path, host: str) -> bool:
    """Whether the netrc file wandb reads (NETRC, else ~/.netrc, else ~/_netrc) has an entry for `host`."""
    candidates = [Path(env["NETRC"]).expanduser()] if env.get("NETRC") else [home / ".netrc", home / "_netrc"]
    path = next((p for p in candidates if p.is_file()), None)
    try:
        return path is not None and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_key_source(env: Mapping[str, str], home: Path) -> Optional[str]:
    """Where wandb would find its credentials without asking, or None: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE,
    a netrc entry for the wandb host (WANDB_BASE_URL, else the settings file's base_url, else api.wandb.ai),
    or `api_key` in wandb's settings file. Reads the environment and files only: no network."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if env.get(var):
            return var
    settings = _wandb_settings_file(env, home)
    base = env.get("WANDB_BASE_URL") or settings.get("default", "base_url", fallback="https://api.wandb.ai")
    if _netrc_has(env, home, urlsplit(base).netloc or "api.wandb.ai"):
        return "netrc"
    return "wandb settings" if settings.get("default", "api_key", fallback="") else None


def check_wandb(mode: str, env: Mapping[str, str], home: Path) -> None:
    """A logging mode other than disabled needs the wandb package; online, a key too. Raises ConfigError."""
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb.mode={mode} needs the wandb package (pip install wandb), or use "
                          "logging.wandb.mode=disabled")
    if mode == "online" and not wandb_key_source(env, home):
        raise ConfigError("logging.wandb.mode=online needs a wandb API key and none was found (WANDB_API_KEY, "
                          "a netrc entry from `wandb login`, wandb's settings): log in, or use "
                          "logging.wandb.mode=offline")


def check_wandb_key(cfg: Config) -> None:
    """`check_wandb` for the run's `logging.wandb` settings, this process's environment and home."""
    check_wandb(WandbSettings.of(cfg.logging.wandb).mode, os.environ, Path.home())


class RunFolders:
    """The locks rank 0 holds on the run's folders (none on the other ranks); a context manager whose exit
    releases them."""

    def __init__(self) -> None:
        self.locks: list[FolderLock] = []

    def take(self, cfg: Config, n_params: int) -> None:
        """The wandb key, then logging.dir and (when the run saves checkpoints) the checkpoint run folder:
        created, probed, locked; the checkpoint folder's free space. Raises ConfigError, holding nothing."""
        check_wandb_key(cfg)
        try:
            log_dir = Path(os.path.abspath(cfg.logging.dir))
            self.locks.append(lock_folder(log_dir, "logging.dir", "logging.dir (or run_name)"))
            ckpt = Path(os.path.abspath(run_root(cfg)))
            if saves_checkpoints(cfg) and os.path.realpath(ckpt) != os.path.realpath(log_dir):
                self.locks.append(lock_folder(ckpt, "checkpoint folder", "checkpoint.dir (or run_name)"))
            if saves_checkpoints(cfg):
                check_space(ckpt, n_params)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> RunFolders:
        return self

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()


def hold_run_folders(cfg: Config, n_params: int, writer: bool) -> RunFolders:
    """Rank 0 (`writer`) takes the run's folders (`RunFolders.take`); every rank gets its answer: the folders
    (held on rank 0, none elsewhere) or the same ConfigError. Collective: one broadcast_object_list."""
    folders, answer = RunFolders(), [None]
    if writer:
        try:
            folders.take(cfg, n_params)
        except ConfigError as e:
            answer[0] = str(e)
        except Exception as e:  # noqa: BLE001  (anything else: still one answer for every rank)
            answer[0] = f"start-up check of the run's folders failed: {type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[0] is not None:
        raise ConfigError(answer[0])
    return folders


def write_fault(e: BaseException, step: int) -> Optional[str]:
    """The line for a write that failed while training (an OSError of `_WRITE_ERRNOS`, also inside DCP's
    CheckpointException or as the cause of Checkpointer.wait's RuntimeError), or None for anything else."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP: loaded by then, if anything saved

    cause: Optional[BaseException] = e
    while cause is not None and not isinstance(cause, (OSError, CheckpointException)):
        cause = cause.__cause__
    if isinstance(cause, CheckpointException):
        failed = [(rank, exc) for rank, (exc, _) in sorted(cause.failures.items()) if isinstance(exc, OSError)]
        cause = failed[0][1] if failed else None
        where = f" (rank {failed[0][0]})" if failed else ""
    else:
        where = ""
    if not isinstance(cause, OSError) or cause.errno not in _WRITE_ERRNOS:
        return None
    return (f"writing the run's files failed after step {step}{where}: {cause}; free space or fix the "
            "folder's permissions, then resume with checkpoint.resume=auto")
