"""Run metrics: model FLOPs and MFU, a step timer, and the sinks (metrics.jsonl, wandb, progress bar).

One `MetricsLogger` exists per rank; only the writer rank (`is_writer=True`) touches files,
imports wandb or draws the progress bar, so every rank can call it unconditionally.

Conventions:
- `step` counts the optimizer steps completed so far (1 after the first step, `total_steps` at the
  end), as the trainer and the checkpoint folders (`step_000100`) count them. A run resumed from
  the checkpoint of step `start_step` keeps the lines with `step <= start_step` and drops the later
  ones that a crashed run may have left, so each step appears once in `metrics.jsonl`.
- `metrics.jsonl` is strict JSON (one object per line, `step` first): tensors and numpy scalars
  become Python numbers, and non-finite floats (NaN, ±inf) are written as `null`.
- wandb's own folders (WANDB_DIR, WANDB_CACHE_DIR, WANDB_CONFIG_DIR, WANDB_DATA_DIR,
  WANDB_ARTIFACT_DIR) are pointed inside the run directory before wandb is imported.
  Console capture is off: `metrics.jsonl` and the run's own log are the record.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch

__all__ = [
    "MetricsLogger", "StepTimer", "format_count", "jsonable", "mfu", "model_flops_per_token", "peak_flops",
]

# Dense bf16 tensor-core peak per GPU (FLOP/s), matched as a substring of the device name.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}
_WANDB_MODES = ("offline", "online", "disabled")
_WANDB_DIRS = {"WANDB_DIR": "", "WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config",
               "WANDB_DATA_DIR": "data", "WANDB_ARTIFACT_DIR": "artifacts"}


def model_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6·N for the weights + 12·L·h·s for attention."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one `device` (A100 312e12, H100/H200 989e12); None for CPU or unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over `n_devices`·`peak` (None when peak is unknown)."""
    if not peak or n_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak)


def format_count(n: float) -> str:
    """Compact count for start-up prints: 1010000000 → '1.01B', 124439808 → '124.4M', 950 → '950'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            value = n / div
            return f"{value:.3g}{suffix}" if value < 100 else f"{value:.1f}{suffix}"
    return f"{n:.4g}" if isinstance(n, float) else str(n)


def jsonable(value: Any) -> Any:
    """Convert metric values to strict-JSON types; tensors/numpy scalars → numbers, NaN/±inf → None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
        return jsonable(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy scalar or 0-d array
        return jsonable(value.item())
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy array
        return jsonable(value.tolist())
    return str(value)


class StepTimer:
    """Wall time of one step and the resulting throughput; synchronizes CUDA so GPU work is included.

    Usage: `timer.start(); ...step...; dt = timer.stop(tokens)`; or `with timer: ...` and set `timer.tokens`.
    `elapsed` and `tokens_per_s` refer to the last stopped step.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        dev = torch.device(device) if device is not None else None
        self.sync = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
        self.tokens = 0
        self.elapsed = 0.0
        self._t0: float | None = None

    def _synchronize(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def start(self) -> None:
        """Mark the beginning of a step (after waiting for queued GPU work)."""
        self._synchronize()
        self._t0 = time.perf_counter()

    def stop(self, tokens: int | None = None) -> float:
        """End the step that processed `tokens` tokens (all ranks' tokens for a global rate); return seconds."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() called before start()")
        self._synchronize()
        self.elapsed = time.perf_counter() - self._t0
        self._t0 = None
        if tokens is not None:
            self.tokens = tokens
        return self.elapsed

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the last stopped step (0.0 before any)."""
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    def __enter__(self) -> StepTimer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _fmt_postfix(metrics: dict[str, Any]) -> str:
    """Short progress-bar postfix: loss, lr, tokens/s, eval loss when present."""
    parts = []
    if isinstance(metrics.get("loss"), (int, float)):
        parts.append(f"loss={metrics['loss']:.4g}")
    if isinstance(metrics.get("lr"), (int, float)):
        parts.append(f"lr={metrics['lr']:.2e}")
    if isinstance(metrics.get("tokens_per_s"), (int, float)):
        parts.append(f"tok/s={format_count(float(metrics['tokens_per_s']))}")
    return " ".join(parts)


class _LineProgress:
    """tqdm's interface for non-terminals: a 'step n/total postfix' line at most every `interval` seconds."""

    def __init__(self, total: int, initial: int, interval: float = 10.0) -> None:
        self.total, self.n, self.interval = total, initial, interval
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._last: float | None = None
        self._shown = initial

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def update(self, k: int) -> None:
        self.n += k
        now = time.perf_counter()
        if self._last is None or now - self._last >= self.interval or self.n >= self.total:
            self._emit(now)

    def _emit(self, now: float) -> None:
        self._last, self._shown = now, self.n
        self.write(f"step {self.n}/{self.total} {self.postfix} [{now - self._t0:.0f}s]".replace("  ", " "))

    def write(self, text: str, file: Any = None) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._shown != self.n:
            self._emit(time.perf_counter())


def _trim_jsonl(path: str, start_step: int) -> None:
    """Keep only well-formed lines with step <= start_step; rewrite atomically (tmp file + rename)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


class MetricsLogger:
    """Per-rank sink for step metrics: metrics.jsonl + wandb + progress bar, all on the writer rank only."""

    def __init__(self, run_dir: str, config: dict, is_writer: bool, total_steps: int,
                 wandb_mode: str = "offline", wandb_project: str = "hybrid", wandb_entity: str | None = None,
                 progress: bool = True, start_step: int = 0, run_name: str = "run") -> None:
        if wandb_mode not in _WANDB_MODES:
            raise ValueError(f"wandb mode {wandb_mode!r} is not one of {', '.join(_WANDB_MODES)}")
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.is_writer = is_writer
        self.total_steps = total_steps
        self.start_step = start_step
        self._file: Any = None
        self._wandb_run: Any = None
        self._bar: Any = None
        self._closed = False
        if not is_writer:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        if start_step > 0:
            _trim_jsonl(self.path, start_step)
        self._file = open(self.path, "a" if start_step > 0 else "w", encoding="utf-8")  # noqa: SIM115 (open for the run)
        if wandb_mode != "disabled":
            try:
                self._wandb_run = self._init_wandb(config, wandb_mode, wandb_project, wandb_entity, run_name)
            except BaseException:
                self._file.close()
                raise
        if progress:
            self._bar = self._make_bar()

    def _init_wandb(self, config: dict, mode: str, project: str, entity: str | None, name: str) -> Any:
        """Point wandb's folders into the run dir, then start a run; online without credentials raises."""
        for var, sub in _WANDB_DIRS.items():
            os.environ[var] = os.path.join(self.run_dir, sub) if sub else self.run_dir
            os.makedirs(os.environ[var], exist_ok=True)
        import wandb  # lazy: slow to import, and never needed when disabled

        if mode == "online":
            try:
                logged_in = wandb.login(prompt=False, verify=False)
            except TypeError:  # older wandb without `prompt`: look where `wandb login` stores the key
                logged_in = _has_wandb_key()
            if not logged_in:
                raise RuntimeError("wandb online mode needs credentials: set WANDB_API_KEY or run `wandb login` "
                                   "(or use logging.wandb.mode=offline)")
        settings = wandb.Settings(console="off", quiet=True)
        try:
            return wandb.init(project=project, entity=entity, name=name, config=jsonable(config),
                              dir=self.run_dir, mode=mode, settings=settings)
        except Exception as e:  # one readable line instead of a wandb traceback
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"wandb.init failed ({mode} mode): {msg}") from e

    def _make_bar(self) -> Any:
        """A tqdm bar on a terminal; plain periodic lines when stderr is a file or pipe (torchrun/Slurm logs)."""
        if not sys.stderr.isatty():
            return _LineProgress(self.total_steps, self.start_step)
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                    file=sys.stderr)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Record the metrics after `step` completed steps; returns the JSON record written (None off the writer)."""
        if not self.is_writer or self._closed:
            return None
        record = {"step": int(step), **{k: v for k, v in jsonable(metrics).items() if k != "step"}}
        self._write(record)
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=int(step))
        if self._bar is not None:
            self._bar.set_postfix_str(_fmt_postfix(record), refresh=False)
            self.update_progress(step)
        return record

    def update_progress(self, step: int) -> None:
        """Move the bar to `step` completed steps without logging (for steps between log lines)."""
        if self._bar is not None and not self._closed:
            done = min(int(step), self.total_steps) if self.total_steps else int(step)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)

    def log_eval(self, step: int, eval_loss: Any) -> None:
        """Record an evaluation: a {step, eval_loss} line, a wandb point, and one printed line."""
        if not self.is_writer or self._closed:
            return
        record = {"step": int(step), "eval_loss": jsonable(eval_loss)}
        self._write(record)
        if self._wandb_run is not None and record["eval_loss"] is not None:
            self._wandb_run.log({"eval_loss": record["eval_loss"]}, step=int(step))
        value = record["eval_loss"]
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

    def close(self, exit_code: int = 0) -> None:
        """Close the bar, the file and the wandb run; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)
