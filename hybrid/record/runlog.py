"""A run's record besides its metrics: `train.log` (rank 0's console lines), the `.hydra/` files, and
`summary.json` with the run's last line.

- `RunLog` (rank 0): while it is entered, `sys.stderr` is a tee, so every line the run prints —
  `hybrid.cli.say`/`warn`/`fail`, `MetricsLogger.message`, the progress lines, `print(..., file=sys.stderr)`,
  Python warnings, the `hybrid.*` loggers' lines (`hybrid.data`'s cache lines) — also reaches
  `<run dir>/train.log`. Lines are held in memory until `open` is called once the run is accepted
  (after `plan_resume`, `nothing_to_do` and the checkpoint load), so a refused re-run writes nothing;
  then the file gets a header line (time, pid, command line) and the held lines. The file is appended
  to across restarts and resumes, flushed line by line. Carriage returns act as on a terminal: a tqdm
  bar reaches the file as its final state only. A Python exception (a bug) leaves its traceback there.
- `save_hydra_files`: Hydra's `.hydra/{config,hydra,overrides}.yaml`, written by the run itself
  (hydra.output_subdir is null in config.yaml, so Hydra writes them for no run) once it is accepted.
- `open_metrics`: the run's `MetricsLogger` (metrics.jsonl, wandb, TensorBoard, progress) from its config.
- `Tally` (a `hybrid.record.sinks.Sink`) keeps what the summary needs; `summary` builds `summary.json`.
  Collective: `gather` — one all_gather_object over the world at the end of the run.
"""

from __future__ import annotations

import logging
import os
import resource
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from hybrid.config import ConfigError
from hybrid.record.metrics import format_bytes, format_count, format_duration, write_atomic
from hybrid.record.sinks import TENSORBOARD_MISSING, MetricsLogger, tensorboard_installed
from hybrid.record.wandb_run import WandbSettings

if TYPE_CHECKING:
    from hybrid.config import Config

HELD_LINES = 5000
"""Lines kept before the run dir is known; later ones are dropped (a run prints a few dozen by then)."""


class _Tee:
    """A text stream that writes to `stream` and hands every write to `feed`."""

    def __init__(self, stream: IO[str], feed: Callable[[str], None]) -> None:
        self.stream, self.feed = stream, feed

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.feed(text)
        return n

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, …
        return getattr(self.stream, name)


class _Say(logging.Handler):
    """The `hybrid.*` loggers' lines on stderr (so through the tee): `data.corpus: building the data cache …`."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"{record.name.removeprefix('hybrid.')}: {record.getMessage()}\n")


def command_line() -> str:
    """How this process was started (`python -m hybrid.train model=… …`)."""
    return shlex.join(getattr(sys, "orig_argv", sys.argv))


class RunLog:
    """Rank 0's console lines, also in `<run dir>/train.log` (see the module docstring). `enabled=False`
    (the other ranks, or a run called from Python) tees nothing and writes nothing."""

    def __init__(self, enabled: bool, command: str = "") -> None:
        self.enabled, self.command = enabled, command
        self.path: Optional[Path] = None
        self._t0 = time.perf_counter()
        self._file: Optional[IO[str]] = None
        self._held: list[str] = []
        self._partial = ""
        self._stderr: Optional[IO[str]] = None
        self._handler = _Say()
        self._logger = logging.getLogger("hybrid")
        self._saved = (self._logger.level, self._logger.propagate)

    def elapsed(self) -> float:
        """Seconds since this start began."""
        return time.perf_counter() - self._t0

    def __enter__(self) -> RunLog:
        if self.enabled:
            self._stderr = sys.stderr
            sys.stderr = _Tee(sys.stderr, self._feed)  # type: ignore[assignment]
            self._logger.addHandler(self._handler)
            self._logger.setLevel(logging.INFO)
            self._logger.propagate = False  # one copy, even if the user set up root logging
        return self

    def _feed(self, text: str) -> None:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if "\r" in line:  # a redrawn bar: what the terminal shows last
                line = line.rsplit("\r", 1)[-1]
                if not line.strip():
                    continue
            self._line(line)

    def _line(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        elif len(self._held) < HELD_LINES:
            self._held.append(line)

    def open(self, run_dir: Path) -> None:
        """The run is accepted: append a header and the held lines to `run_dir/train.log`, then every line."""
        if not self.enabled or self._file is not None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "train.log"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        self._file.write(f"==== {stamp} start (pid {os.getpid()}): {self.command}\n")
        for line in self._held:
            self._line(line)
        self._held.clear()

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if not self.enabled:
            return
        if self._partial:
            self._feed("\n")
        if self._file is not None and exc is not None and not isinstance(exc, SystemExit):
            self._file.write("".join(traceback.format_exception(kind, exc, tb)))  # Hydra prints it to stderr
        sys.stderr = self._stderr  # type: ignore[assignment]
        self._logger.removeHandler(self._handler)
        self._logger.level, self._logger.propagate = self._saved
        if self._file is not None:
            self._file.close()
            self._file = None


def save_hydra_files(cfg: Any, run_dir: Path) -> None:
    """`.hydra/config.yaml` (the job's config), `hydra.yaml` and `overrides.yaml` in `run_dir`, as Hydra
    writes them; nothing outside Hydra, or when the user set hydra.output_subdir (Hydra wrote them)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is not None:
        return
    hc = HydraConfig.get()
    folder = run_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(folder / "hydra.yaml", OmegaConf.to_yaml({"hydra": hc}))
    write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(hc.overrides.task))


class Tally:
    """A sink keeping what the summary reports: first and last train loss, last eval loss, and the
    tokens/s of the logged steps after the first one of this start (that one pays for warm-up)."""

    def __init__(self, start_step: int) -> None:
        self.start_step = start_step
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None
        self.last_eval: Optional[float] = None
        self.rates: list[float] = []

    def log(self, step: int, record: dict[str, Any]) -> None:
        if "loss" in record:
            self.first_loss = record["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = record["loss"]
        if "eval_loss" in record:
            self.last_eval = record["eval_loss"]
        rate = record.get("tokens_per_s")
        if isinstance(rate, (int, float)) and step > self.start_step + 1:
            self.rates.append(float(rate))

    def close(self, exit_code: int) -> None:
        pass


def peak_memory(device: torch.device) -> int:
    """This process's peak memory in bytes: CUDA's max_memory_allocated on a GPU, else the process's
    max resident set size (getrusage; KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)


def gather(value: Any) -> list[Any]:
    """`value` from every rank, in rank order: one all_gather_object over the world (just [value] alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ended(step: int, steps: int, signals: Sequence[int]) -> str:
    """How a run ended: completed (train.steps reached), or saved on the signal some rank caught."""
    if step >= steps:
        return "completed"
    return f"signal save ({signal.Signals(max(signals)).name})" if any(signals) else "stopped"


def summary(tally: Tally, steps: tuple[int, int], wall_s: float, ranks: Sequence[tuple[int, int]],
            device: torch.device, checkpoints: Sequence[str], log: Optional[Path],
            communication: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """summary.json's content. `steps`: (step reached, train.steps); `ranks`: (peak memory, signal caught)
    of every rank (`peak_memory` on `device`'s type); `communication`: the backend and its settings
    (`comm_env.communication`)."""
    mean = sum(tally.rates) / len(tally.rates) if tally.rates else None
    peaks, end_step = [peak for peak, _ in ranks], steps[0]
    memory_kind = "cuda max_memory_allocated" if device.type == "cuda" else "max RSS"
    return {"start_step": tally.start_step, "end_step": end_step, "wall_s": round(wall_s, 3),
            "ended": ended(*steps, [caught for _, caught in ranks]),
            "first_loss": tally.first_loss, "final_loss": tally.last_loss, "final_eval_loss": tally.last_eval,
            "mean_tokens_per_s": mean, "tokens_per_s_excludes_first_step": True,
            "logged_steps_averaged": len(tally.rates),
            "peak_memory_bytes": list(peaks), "peak_memory": memory_kind, "checkpoints": list(checkpoints),
            "export": None, "log": str(log) if log else None, "communication": communication}


def _num(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def summary_line(doc: dict[str, Any]) -> str:
    """'done: 100 steps in 3m12s, loss 9.01 → 5.8, eval 5.95, 12.3K tokens/s, peak mem …, checkpoint …, log …'."""
    steps = doc["end_step"] - doc["start_step"]
    head = {"completed": "done", "stopped": "stopped"}.get(doc["ended"], f"stopped ({doc['ended']})")
    parts = [f"{head}: {steps} steps (to step {doc['end_step']}) in {format_duration(doc['wall_s'])}",
             f"loss {_num(doc['first_loss'])} → {_num(doc['final_loss'])}", f"eval {_num(doc['final_eval_loss'])}"]
    if doc["mean_tokens_per_s"] is not None:
        parts.append(f"{format_count(doc['mean_tokens_per_s'])} tokens/s")
    peaks = doc["peak_memory_bytes"]
    parts.append(f"peak mem {format_bytes(max(peaks))} ({doc['peak_memory']}, max over {len(peaks)} rank(s))")
    parts.append(f"checkpoint {doc['checkpoints'][-1] if doc['checkpoints'] else 'none'}")
    return ", ".join([*parts, f"log {doc['log'] or 'none'}"])


def write_summary(run_dir: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """Write `doc` to `run_dir/summary.json`, atomically; returns it."""
    import json

    write_atomic(run_dir / "summary.json", json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return doc


def open_metrics(cfg: Config, writer: bool, start_step: int = 0, extra: tuple[Any, ...] = ()) -> MetricsLogger:
    """Rank 0 writes metrics.jsonl (lines after `start_step` dropped), wandb (`WandbSettings.of`), TensorBoard,
    the `extra` sinks and the progress bar; a wandb failure, or no tensorboard (any rank), is bad input."""
    from omegaconf import OmegaConf

    w, tensorboard = cfg.logging.wandb, bool(getattr(cfg.logging, "tensorboard", False))
    if tensorboard and not tensorboard_installed():
        raise ConfigError(TENSORBOARD_MISSING)
    s = WandbSettings.of(w)
    try:
        return MetricsLogger(cfg.logging.dir, OmegaConf.to_container(cfg, resolve=True), is_writer=writer,
                             total_steps=cfg.train.steps, wandb_mode=s.mode, wandb_project=s.project,
                             wandb_entity=s.entity, progress=cfg.logging.progress, run_name=cfg.run_name,
                             start_step=start_step, wandb_group=s.group, wandb_tags=s.tags, tensorboard=tensorboard,
                             extra=extra)
    except RuntimeError as e:
        raise ConfigError(str(e)) from None
