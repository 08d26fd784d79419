"""Run metrics: model FLOPs and MFU, a step timer, JSON-safe values, the formats of the lines a run
prints (counts, durations, byte sizes, the progress line), the grouped names wandb and TensorBoard show
(`metric_name`), and the atomic write every record file goes through. Where metrics go (metrics.jsonl, wandb,
TensorBoard) is `hybrid.record.sinks`; the run's log file and summary are `hybrid.record.runlog`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LineProgress", "format_bytes", "format_count", "format_duration", "grouped", "jsonable", "metric_name", "mfu",
    "model_flops_per_token", "peak_flops", "progress_postfix", "write_atomic",
]
PERF_KEYS = frozenset({"tokens_per_s", "step_time_s", "gflops_per_rank", "mfu"})

# Dense bf16 tensor-core peak per GPU (FLOP/s, NVIDIA's data sheets without sparsity), matched in this order as a
# substring of the device name: the PCIe and NVL H100s before the SXM one ("NVIDIA H100 80GB HBM3").
_PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "GH200": 989e12, "H200": 989e12, "H100": 989e12,
              "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12}


def model_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6·N for the weights + 12·L·h·s for attention."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one `device` (A100 312e12, H100 SXM/H200 989e12, …); None for CPU or unknown."""
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


def format_duration(seconds: float) -> str:
    """Wall time for a line: 3.2 → '3.2s', 192 → '3m12s', 7384 → '2h03m'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes}m{s:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def format_bytes(n: float) -> str:
    """Binary byte size for a line: 1536 → '1.5 KiB', 3 * 2**30 → '3.0 GiB'."""
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


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


def progress_postfix(metrics: dict[str, Any]) -> str:
    """Short progress-bar postfix: loss, lr, tokens/s, eval loss when present."""
    parts = []
    if isinstance(metrics.get("loss"), (int, float)):
        parts.append(f"loss={metrics['loss']:.4g}")
    if isinstance(metrics.get("lr"), (int, float)):
        parts.append(f"lr={metrics['lr']:.2e}")
    if isinstance(metrics.get("tokens_per_s"), (int, float)):
        parts.append(f"tok/s={format_count(float(metrics['tokens_per_s']))}")
    return " ".join(parts)


class LineProgress:
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



def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a tmp file and a rename: a reader sees the old or the new file."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
