"""The wandb sink: `logging.wandb.*` with the environment's precedence (`WandbSettings`), the run id a continued
run keeps, and `WandbSink` (a `hybrid.record.sinks.Sink`). Only the writer rank opens it; wandb is imported
only when a run is opened (slow to import, never needed when disabled). No collective here.

- wandb's folders: runs go to `<run dir>/wandb/`, its cache, config, data and artifact folders to
  `<run dir>/wandb/{cache,config,data,artifacts}` — except where the user set WANDB_DIR or
  WANDB_{CACHE,CONFIG,DATA,ARTIFACT}_DIR, never overwritten (those set here are removed at close).
- The run id is kept in `<run dir>/wandb/run_id`: a run that continues (start_step > 0) continues that wandb
  run (`resume="allow"`); a fresh start gets a new id. Console capture is off: `train.log` is the record.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hybrid.record.metrics import grouped, jsonable, write_atomic

if TYPE_CHECKING:
    from hybrid.config import WandbConfig

WANDB_MODES = ("offline", "online", "disabled")
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # wandb's older names for WANDB_MODE
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data",
              "WANDB_ARTIFACT_DIR": "artifacts"}


@dataclass(frozen=True)
class WandbSettings:
    """What wandb.init gets from `logging.wandb.*`."""

    mode: str = "offline"
    project: str = "hybrid"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, w: WandbConfig, env: Optional[Mapping[str, str]] = None) -> WandbSettings:
        """From `logging.wandb` (a WandbConfig), then `with_env(env)` (os.environ by default)."""
        s = cls(w.mode, w.project, w.entity, w.group, tuple(w.tags))
        return s.with_env(os.environ if env is None else env)

    def with_env(self, env: Mapping[str, str]) -> WandbSettings:
        """The precedence rule: a value left at its default yields to WANDB_MODE, WANDB_PROJECT,
        WANDB_ENTITY or WANDB_RUN_GROUP when set; a value given in the config wins over the env."""
        default, changes = WandbSettings(), {}
        for f, var in zip(fields(self)[:4], ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP")):
            if getattr(self, f.name) == getattr(default, f.name) and env.get(var):
                changes[f.name] = env[var]
        mode = str(changes.get("mode", self.mode)).lower()
        changes["mode"] = _MODE_ALIASES.get(mode, mode)
        return replace(self, **changes)


def _has_wandb_key() -> bool:
    """Whether WANDB_API_KEY or a ~/.netrc entry for the wandb host holds an API key."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_run_id(folder: Path, start_step: int) -> str:
    """The wandb run id of a run folder: the one kept in `folder/run_id` when the run continues
    (`start_step` > 0), else a new one, kept there for the next start."""
    path = folder / "run_id"
    saved = path.read_text(encoding="utf-8").strip() if start_step > 0 and path.is_file() else ""
    if saved:
        return saved
    new = secrets.token_hex(4)  # 8 of wandb's id characters [a-z0-9]
    write_atomic(path, new + "\n")
    return new


class WandbSink:
    """A wandb run under `<run dir>/wandb/`; online mode without credentials raises RuntimeError."""

    def __init__(self, run_dir: Path, config: dict, s: WandbSettings, name: str, start_step: int) -> None:
        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.env_set = [var for var in WANDB_DIRS if not os.environ.get(var)]  # the user's own are kept
        for var in self.env_set:
            os.environ[var] = str(folder / WANDB_DIRS[var])
            os.makedirs(os.environ[var], exist_ok=True)
        try:
            self.run = self._init(run_dir, config, s, name, wandb_run_id(folder, start_step))
        except BaseException:
            self._restore_env()
            raise

    def _init(self, run_dir: Path, config: dict, s: WandbSettings, name: str, run_id: str) -> Any:
        import wandb  # lazy: slow to import, and never needed when disabled

        if s.mode == "online":
            try:
                logged_in = wandb.login(prompt=False, verify=False)
            except TypeError:  # older wandb without `prompt`: look where `wandb login` stores the key
                logged_in = _has_wandb_key()
            if not logged_in:
                raise RuntimeError("wandb online mode needs credentials: set WANDB_API_KEY or run `wandb login` "
                                   "(or use logging.wandb.mode=offline)")
        where = None if os.environ.get("WANDB_DIR") else str(run_dir)  # wandb adds its own wandb/ folder
        try:
            return wandb.init(project=s.project, entity=s.entity, name=name, group=s.group, tags=list(s.tags) or None,
                              config=jsonable(config), dir=where, mode=s.mode, id=run_id, resume="allow",
                              settings=wandb.Settings(console="off", quiet=True))
        except Exception as e:  # one readable line instead of a wandb traceback
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"wandb.init failed ({s.mode} mode): {msg}") from e

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(grouped(record), step=step)

    def _restore_env(self) -> None:
        for var in self.env_set:
            os.environ.pop(var, None)

    def close(self, exit_code: int) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        finally:
            self._restore_env()
