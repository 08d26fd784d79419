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
  tokens_per_s → perf/tokens_per_s, bytes_dp → traffic/bytes_dp; names with a `/` are kept (`hybrid.record.metrics`).
- wandb's folders and run id: `hybrid.record.wandb_run`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybrid.record.metrics import LineProgress, grouped, jsonable, progress_postfix, write_atomic
from hybrid.record.wandb_run import WANDB_MODES, WandbSettings, WandbSink

if TYPE_CHECKING:
    pass

TENSORBOARD_MISSING = "logging.tensorboard=true needs the tensorboard package (pip install tensorboard)"


class Sink(Protocol):
    """One place metrics go. `record` holds a step's JSON-safe values, without `step`."""

    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self, exit_code: int) -> None: ...


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
