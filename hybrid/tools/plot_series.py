"""A run's metrics.jsonl as series: the pure half of `hybrid.tools.plot` (no matplotlib here).

A run writes one JSON object per line into `<logging.dir>/metrics.jsonl`: a training record per logged
step (`StepReport.record`: loss, tokens_per_s, bytes_<group>, compression_ratio/error, comm/ and time/
keys) and an evaluation line `{step, eval_loss}` per eval. A resumed run trims its lines after the step
it restarts from; a file appended to without trimming may repeat a step, and the last line for a step
wins. Grouped names (`train/loss`, `eval/loss`) read as `loss`, `eval_loss`. The tokens seen by a step
come from the run's config (`.hydra/config.yaml`, which Hydra writes on rank 0):
step · train.global_batch_size · data.seq_len.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hybrid.cli import UsageError

Points = tuple[list[float], list[float]]
"""(x, y) of one series, in step order."""
GROUPS = ("dp", "dp_inter", "tp", "pp", "embedding")  # the record's bytes_<group> keys, in drawing order


@dataclass
class Run:
    """One run's metrics: per step, every numeric key its lines carry."""

    label: str
    folder: Path
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    tokens_per_step: Optional[int] = None  # global_batch_size · seq_len, None without the run's config

    def series(self, key: str) -> Points:
        """(steps, values) of `key` over the steps that carry it."""
        pts = [(s, rec[key]) for s, rec in sorted(self.steps.items()) if key in rec]
        return [float(s) for s, _ in pts], [v for _, v in pts]

    def has(self, key: str) -> bool:
        return any(key in rec for rec in self.steps.values())

    def keys(self) -> set[str]:
        return {k for rec in self.steps.values() for k in rec}


def canonical(key: str) -> str:
    """`train/loss` → `loss`, `eval/loss` → `eval_loss`; other names unchanged."""
    if key.startswith("train/"):
        return key[len("train/"):]
    if key.startswith("eval/"):
        return "eval_" + key[len("eval/"):]
    return key


def metrics_path(arg: str) -> Path:
    """The metrics.jsonl a command-line argument names: a run folder or the file itself."""
    p = Path(arg)
    path = p / "metrics.jsonl" if p.is_dir() else p
    if not path.is_file():
        what = "has no metrics.jsonl" if p.is_dir() else "no such run folder or metrics.jsonl"
        raise UsageError(f"{arg}: {what}")
    return path


def parse_lines(text: str, name: str) -> dict[int, dict[str, float]]:
    """The numeric keys of each line, per step (a later line for a step overrides an earlier one's keys).
    A last line without its newline that is not JSON is a line still being written: left out."""
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines if _is_json(lines[-1]) else lines[:-1]
    steps: dict[int, dict[str, float]] = {}
    for n, line in enumerate(lines, 1):
        if line.strip():
            step, rec = _parse_line(line, f"{name} line {n}")
            steps[step] = {**steps.get(step, {}), **rec}
    if not steps:
        raise UsageError(f"{name} has no records")
    return steps


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _parse_line(line: str, where: str) -> tuple[int, dict[str, float]]:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where} is not JSON: {e}") from None
    step = obj.get("step") if isinstance(obj, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise UsageError(f"{where} has no integer 'step': not a metrics.jsonl written by hybrid.train")
    return step, {canonical(k): float(v) for k, v in obj.items() if k != "step" and _number(v)}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def tokens_per_step(folder: Path) -> Optional[int]:
    """train.global_batch_size · data.seq_len from `<folder>/.hydra/config.yaml`, or None."""
    import yaml

    try:
        cfg = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
        batch, seq = cfg["train"]["global_batch_size"], cfg["data"]["seq_len"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return batch * seq if isinstance(batch, int) and isinstance(seq, int) else None


def load_run(arg: str, label: Optional[str] = None) -> Run:
    """A run from a run folder or a metrics.jsonl path; the label defaults to the run folder's name."""
    path = metrics_path(arg)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    folder = path.parent
    return Run(label or folder.resolve().name, folder, parse_lines(text, str(path)), tokens_per_step(folder))


def group_bytes(run: Run) -> dict[str, Points]:
    """Bytes per step of each group that sent any: `bytes_<group>`, else the sum of its
    `comm/<group>/<op>/bytes` (timed steps only)."""
    out: dict[str, Points] = {}
    for g in GROUPS:
        xs, ys = run.series(f"bytes_{g}") if run.has(f"bytes_{g}") else _comm_bytes(run, g)
        if any(ys):
            out[g] = (xs, ys)
    return out


def _comm_bytes(run: Run, group: str) -> Points:
    prefix = f"comm/{group}/"
    pts = [(float(s), sum(v for k, v in rec.items() if k.startswith(prefix) and k.endswith("/bytes")))
           for s, rec in sorted(run.steps.items()) if any(k.startswith(prefix) for k in rec)]
    return [x for x, _ in pts], [y for _, y in pts]


def time_parts(run: Run) -> dict[str, float]:
    """The `time/<part>_s` keys (the step's total left out) averaged over the timed steps, the first one
    left out when there are others (it carries the warm-up); empty when no step was timed."""
    timed = [rec for _, rec in sorted(run.steps.items()) if "time/step_s" in rec]
    timed = timed[1:] if len(timed) > 1 else timed
    keys = sorted({k for rec in timed for k in rec if k.startswith("time/") and k != "time/step_s"}, key=_part_order)
    return {k[len("time/"):-len("_s")]: sum(rec.get(k, 0.0) for rec in timed) / len(timed) for k in keys}


PART_ORDER = ("compute", "data", "optimizer", "bubble")


def _part_order(key: str) -> tuple[int, str]:
    """compute, data, optimizer, bubble, then comm_<group>s and meter by name, other last."""
    part = key[len("time/"):-len("_s")]
    rank = PART_ORDER.index(part) if part in PART_ORDER else 9 if part == "other" else len(PART_ORDER)
    return rank, part


def moving_average(ys: list[float], n: int) -> list[float]:
    """The trailing mean over the last `n` points (fewer at the start); n <= 1 returns ys unchanged."""
    if n <= 1:
        return list(ys)
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out
