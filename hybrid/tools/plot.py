"""Draw runs' metrics.jsonl as PNG figures, several runs overlaid.

    python -m hybrid.tools.plot runs/<run> [runs/<other> ...] [--out DIR] [--labels a,b]
                                [--only loss,throughput,bytes,compression,budget,time] [--x step|tokens] [--smooth N]

A run is a run folder (its metrics.jsonl, and .hydra/config.yaml for the tokens axis) or a metrics.jsonl
path. Figures: loss (training and eval loss), throughput (tokens/s), bytes (per group per step),
compression (ratio and error of the DP gradient sync), budget (the first run's error and rank or density per DP
bucket), time (the step's breakdown, one bar per run).
Without --x the loss is drawn against steps and against tokens seen, the others against steps.
--out defaults to <run>/plots for one run, plots/ for several; --labels defaults to the run folders' names;
--smooth N draws an N-point moving average over the faint logged values. A figure whose keys no run has is
skipped with a note on stderr. Prints the PNGs written. Bad input (no such run, an empty or invalid
metrics.jsonl, an unknown option) is one `hybrid: error: ...` line and exit status 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool, warn
from hybrid.tools.plot_figures import FIGURES, Skipped
from hybrid.tools.plot_series import Run, load_run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
VALUE_FLAGS = ("--out", "--labels", "--only", "--x", "--smooth")


@dataclass
class Options:
    """The parsed command line."""

    runs: list[str] = field(default_factory=list)
    out: Optional[str] = None
    labels: Optional[list[str]] = None
    only: list[str] = field(default_factory=lambda: list(FIGURES))
    x: Optional[str] = None  # None: loss against step and tokens, the rest against step
    smooth: int = 1


def parse_args(argv: list[str]) -> Options:
    """Run arguments and `--flag VALUE` (or `--flag=VALUE`) pairs; UsageError on anything else."""
    opts, words = Options(), list(argv)
    while words:
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        if flag not in VALUE_FLAGS:
            if word.startswith("-"):
                raise UsageError(f"unknown option {word!r}; expected {', '.join(VALUE_FLAGS)}")
            opts.runs.append(word)
            continue
        if not eq:
            if not words:
                raise UsageError(f"{flag} needs a value")
            value = words.pop(0)
        _set(opts, flag, value)
    return _checked(opts)


def _set(opts: Options, flag: str, value: str) -> None:
    if flag == "--out":
        opts.out = value
    elif flag == "--labels":
        opts.labels = value.split(",")
    elif flag == "--only":
        opts.only = [w.strip() for w in value.split(",") if w.strip()]
    elif flag == "--x":
        opts.x = value
    else:
        try:
            opts.smooth = int(value)
        except ValueError:
            raise UsageError(f"--smooth must be an integer, got {value!r}") from None


def _checked(opts: Options) -> Options:
    if not opts.runs:
        raise UsageError("expected at least one run folder or metrics.jsonl path")
    unknown = [w for w in opts.only if w not in FIGURES]
    if unknown or not opts.only:
        names = ", ".join(unknown) or "(none)"
        raise UsageError(f"--only: unknown figure {names}; expected some of {','.join(FIGURES)}")
    if opts.x not in (None, "step", "tokens"):
        raise UsageError(f"--x must be step or tokens, got {opts.x!r}")
    if opts.smooth < 1:
        raise UsageError(f"--smooth must be >= 1, got {opts.smooth}")
    if opts.labels is not None and len(opts.labels) != len(opts.runs):
        raise UsageError(f"--labels gives {len(opts.labels)} label(s) for {len(opts.runs)} run(s)")
    return opts


def load_runs(opts: Options) -> list[Run]:
    labels = opts.labels or [None] * len(opts.runs)
    return [load_run(arg, label) for arg, label in zip(opts.runs, labels)]


def out_dir(opts: Options, runs: list[Run]) -> Path:
    """--out, else <run>/plots for one run, plots/ for several."""
    if opts.out:
        return Path(opts.out)
    return runs[0].folder / "plots" if len(runs) == 1 else Path("plots")


def plan(opts: Options) -> list[tuple[str, str]]:
    """(figure, x axis) pairs to draw, in order; the time breakdown has no x axis."""
    out = []
    for name in opts.only:
        if name == "time":
            out.append((name, ""))
        elif opts.x:
            out.append((name, opts.x))
        else:
            out += [(name, "step"), (name, "tokens")] if name == "loss" else [(name, "step")]
    return out


def png_name(name: str, x: str) -> str:
    return f"{name}_{x}.png" if x else f"{name}.png"


def build(name: str, x: str, runs: list[Run], smooth: int) -> Figure:
    """The figure `name` against `x` (Skipped when the runs lack its keys)."""
    return FIGURES[name](runs, x or "step", smooth)


def save(fig: Figure, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def run(opts: Options) -> str:
    """Load the runs, draw each planned figure, write the PNGs; notes for the skipped ones."""
    runs = load_runs(opts)
    folder, written = out_dir(opts, runs), []
    for name, x in plan(opts):
        try:
            fig = build(name, x, runs, opts.smooth)
        except Skipped as e:
            warn(f"note: {png_name(name, x)} skipped: {e}")
            continue
        save(fig, folder / png_name(name, x))
        written.append(str(folder / png_name(name, x)))
    if not written:
        return f"no figure written into {folder}"
    return "\n".join(["wrote"] + [f"  {p}" for p in written])


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: the PNGs written and 0, or one error line and 2 (`hybrid.cli.run_tool`)."""
    return run_tool(__doc__, argv, lambda args: run(parse_args(args)), [(UsageError, EXIT_BAD_INPUT)])


if __name__ == "__main__":
    sys.exit(main())
