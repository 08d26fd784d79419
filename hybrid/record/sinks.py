"""Where step metrics go: `metrics.jsonl`, wandb and TensorBoard, each a `Sink`, fed by the rank's
`MetricsLogger`, which also draws the progress bar. Only the writer rank (`is_writer=True`) opens a sink,
imports wandb or tensorboard, or draws the bar, so every rank calls the logger. No collective here.

Conventions:
- `step` counts the optimizer steps completed so far (1 after the first step, `total_steps` at the
  end), as the trainer and the checkpoint folders (`step_000100`) count them. A run resumed from
  the checkpoint of step `start_step` keeps the lines with `step <= start_step` and drops the later
  ones that a crashed run may have left, so each step appears once in `metrics.jsonl` (TensorBoard:
  `purge_step`; wandb ignores steps it already has).
- `metrics.jsonl` is strict JSON with flat keys (one object per line, `step` first): tensors and numpy
  scalars become Python numbers, and non-finite floats (NaN, ±inf) are written as `null`.
- wandb and TensorBoard get grouped names (`metric_name`): loss → train/loss, eval_loss → eval/loss,
  tokens_per_s → perf/tokens_per_s, bytes_dp → traffic/bytes_dp; names with a `/` are kept.
- wandb's folders: runs go to `<run dir>/wandb/`, its cache, config, data and artifact folders to
  `<run dir>/wandb/{cache,config,data,artifacts}` — except where the user set WANDB_DIR or
  WANDB_{CACHE,CONFIG,DATA,ARTIFACT}_DIR, never overwritten (those set here are removed at close). The run id is kept in
  `<run dir>/wandb/run_id`: a run that continues (start_step > 0) continues that wandb run
  (`resume="allow"`); a fresh start gets a new id. Console capture is off: `train.log` is the record.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from hybrid.record.metrics import LineProgress, jsonable, progress_postfix

if TYPE_CHECKING:
    from hybrid.config import WandbConfig

WANDB_MODES = ("offline", "online", "disabled")
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # wandb's older names for WANDB_MODE
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data",
              "WANDB_ARTIFACT_DIR": "artifacts"}
PERF_KEYS = frozenset({"tokens_per_s", "step_time_s", "gflops_per_rank", "mfu"})
TENSORBOARD_MISSING = "logging.tensorboard=true needs the tensorboard package (pip install tensorboard)"


def metric_name(key: str) -> str:
    """The grouped name of a metrics.jsonl key for wandb and TensorBoard."""
    if "/" in key:
        return key
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    if key in PERF_KEYS:
        return "perf/" + key
    if key.startswith("bytes_"):
        return "traffic/" + key
    return "train/" + key


def grouped(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a record under their grouped names (`step` and nulls left out)."""
    return {metric_name(k): v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Sink(Protocol):
    """One place metrics go. `record` holds a step's JSON-safe values, without `step`."""

    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self, exit_code: int) -> None: ...


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a tmp file and a rename: a reader sees the old or the new file."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _trim_jsonl(path: Path, start_step: int) -> None:
    """Keep only well-formed lines with step <= start_step; rewrite atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start_step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept))


class JsonlSink:
    """`metrics.jsonl`: one flushed line per record (a killed run keeps what it logged)."""

    def __init__(self, path: Path, start_step: int) -> None:
        if start_step > 0:
            _trim_jsonl(path, start_step)
        self.file = open(path, "a" if start_step > 0 else "w", encoding="utf-8")  # noqa: SIM115 (open for the run)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **record}, allow_nan=False) + "\n")
        self.file.flush()

    def close(self, exit_code: int) -> None:
        self.file.close()


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


def tensorboard_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


class TensorBoardSink:
    """Scalars under `<run dir>/tensorboard/` (torch's SummaryWriter), with the grouped names."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(TENSORBOARD_MISSING) from None
        # a continued run drops the events a crashed run left after its checkpoint
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None,
                                    flush_secs=10)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for name, value in grouped(record).items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self, exit_code: int) -> None:
        self.writer.close()


class MetricsLogger:
    """Per-rank entry for step metrics: metrics.jsonl, wandb, TensorBoard, any `extra` sinks and the
    progress bar, all on the writer rank only."""

    def __init__(self, run_dir: str, config: dict, is_writer: bool, total_steps: int,
                 wandb_mode: str = "offline", wandb_project: str = "hybrid", wandb_entity: str | None = None,
                 progress: bool = True, start_step: int = 0, run_name: str = "run", *,
                 wandb_group: str | None = None, wandb_tags: Sequence[str] = (), tensorboard: bool = False,
                 extra: Sequence[Sink] = ()) -> None:
        if wandb_mode not in WANDB_MODES:
            raise RuntimeError(f"wandb mode {wandb_mode!r} is not one of {', '.join(WANDB_MODES)}")
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.is_writer, self.total_steps, self.start_step = is_writer, total_steps, start_step
        self.sinks: list[Sink] = []
        self._bar: Any = None
        self._closed = False
        if not is_writer:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        wandb = WandbSettings(wandb_mode, wandb_project, wandb_entity, wandb_group, tuple(wandb_tags))
        self._open(config, wandb, run_name, tensorboard)
        self.sinks += extra
        if progress:
            self._bar = self._make_bar()

    def _open(self, config: dict, wandb: WandbSettings, run_name: str, tensorboard: bool) -> None:
        """Open the file sinks in turn; if one fails, close those already open and raise."""
        run_dir = Path(self.run_dir)
        try:
            self.sinks.append(JsonlSink(Path(self.path), self.start_step))
            if wandb.mode != "disabled":
                self.sinks.append(WandbSink(run_dir, config, wandb, run_name, self.start_step))
            if tensorboard:
                self.sinks.append(TensorBoardSink(run_dir, self.start_step))
        except BaseException:
            for sink in self.sinks:
                sink.close(1)
            raise

    def _make_bar(self) -> Any:
        """A tqdm bar on a terminal; plain periodic lines when stderr is a file or pipe (torchrun/Slurm logs)."""
        if not sys.stderr.isatty():
            return LineProgress(self.total_steps, self.start_step)
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                    file=sys.stderr)

    def _emit(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {k: v for k, v in jsonable(metrics).items() if k != "step"}
        for sink in self.sinks:
            sink.log(int(step), record)
        return {"step": int(step), **record}

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Record the metrics after `step` completed steps; returns the JSON record written (None off the writer)."""
        if not self.is_writer or self._closed:
            return None
        record = self._emit(step, metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(progress_postfix(record), refresh=False)
            self.update_progress(step)
        return record

    def update_progress(self, step: int) -> None:
        """Move the bar to `step` completed steps without logging (for steps between log lines)."""
        if self._bar is not None and not self._closed:
            done = min(int(step), self.total_steps) if self.total_steps else int(step)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)

    def log_eval(self, step: int, eval_loss: Any) -> None:
        """Record an evaluation: a {step, eval_loss} line, an eval/loss point, and one printed line."""
        if not self.is_writer or self._closed:
            return
        value = self._emit(step, {"eval_loss": eval_loss})["eval_loss"]
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else str(value)
        self.message(f"step {step}: eval_loss {shown}")

    def message(self, text: str) -> None:
        """Print one line on the writer without breaking the progress bar."""
        if not self.is_writer:
            return
        if self._bar is not None and not self._closed:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0, last_line: str = "") -> None:
        """Close the bar and the sinks, then print `last_line` (the run's summary) after the bar's last
        line; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        for sink in self.sinks:
            sink.close(exit_code)
        if last_line:
            self.message(last_line)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)
