"""What every `python -m hybrid.bench.<name>` shares: sections on the command line, the command
that reproduces a run (every setting spelled out), the header and the timed run of the sections."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench.model_size import model_names

Section = Callable[[argparse.Namespace, Callable[[str], None]], Any]


def split_sections(p: argparse.ArgumentParser, args: argparse.Namespace, known: Sequence[str]) -> None:
    """Turn `--sections a,b` into a list, refusing (parser error, exit 2) names not in `known`."""
    args.sections = [s for s in args.sections.split(",") if s]
    if not args.sections or any(s not in known for s in args.sections):
        p.error(f"--sections must be a comma-separated subset of {','.join(known)}")


def parse_with_quick(p: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: dict[str, Any],
                     sections: Sequence[str]) -> argparse.Namespace:
    """Parse `argv`; with `--quick`, `quick`'s values become the defaults (options given explicitly
    still win). `args.quick` is then cleared: the reproduce command spells out every value instead."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    args.quick = None
    split_sections(p, args, sections)
    return args


def check_models(p: argparse.ArgumentParser, *models: str) -> None:
    """Refuse (parser error, exit 2) a model name that configs/model does not have."""
    for m in models:
        if m not in model_names():
            p.error(f"unknown model {m}; configs/model has {', '.join(model_names())}")


def reproduce_command(module: str, p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command line that repeats this run: every option of `p` with the value it had."""
    words = [f"OMP_NUM_THREADS=1 PYTHONPATH=. python -m {module}"]
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "help" or value is None:
            continue
        if action.dest == "sections":
            value = ",".join(value)
        elif isinstance(value, (list, tuple)):
            value = " ".join(map(str, value))
        words.append(f"{action.option_strings[0]} {value}")
    return " ".join(words)


def header(module: str, command: str) -> str:
    """The exact command, torch version and threads."""
    return (f"# {module} — torch {torch.__version__}, {os.cpu_count()} CPUs, parent threads "
            f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
            f"each rank 1 thread, gloo over local TCP\n# command: {command}")


def run_sections(sections: Sequence[tuple[str, Section]], args: argparse.Namespace, command: str,
                 module: str, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections in order, each timed; returns their rows (for tests)."""
    out(header(module, command))
    start, result, load = time.perf_counter(), {}, os.getloadavg()[0]
    for name, fn in sections:
        if name in args.sections:
            t = time.perf_counter()
            result[name] = fn(args, out)
            out(f"({name}: {time.perf_counter() - t:.1f} s)")
    out(f"\ntotal {time.perf_counter() - start:.1f} s; 1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} "
        f"after (ours counts for up to 2 of it); reproduce: {command}")
    return result
