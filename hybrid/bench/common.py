"""What every `python -m hybrid.bench.<name>` shares: `--quick` and `--sections` on the command line, the
command that reproduces a run (every setting spelled out), the header, the timed run, the tables, and `launch`
(forked gloo ranks that inherit the imports a training rank would otherwise make by itself)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hybrid.bench.model_size import model_names
from hybrid.testing import ranks

Section = Callable[[argparse.Namespace, Callable[[str], None]], Any]
NUMBER = re.compile(r"^[+-]?[\d,.]+(%|×)?( \(\w\))?$")  # table cells right-aligned: 1,234  -0.5%  2.00× (c)


def launch(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`hybrid.testing.ranks.launch`, after importing here what each rank would import by itself: torch._dynamo,
    which torch imports lazily on the first optimizer, parameter initialisation or other `_disable_dynamo` call
    (about a CPU-second a process); forked ranks inherit it."""
    import torch._dynamo  # noqa: F401

    return ranks.launch(fn, world, *args, **kwargs)


def add_sections(p: argparse.ArgumentParser, known: Sequence[str]) -> None:
    """`--sections a,b`: which of `known` to run (default: all, in that order)."""
    p.add_argument("--sections", default=",".join(known), help="comma-separated subset of " + ",".join(known))


def add_quick(p: argparse.ArgumentParser, what: str) -> None:
    """`--quick`: the module's QUICK values become the defaults (see `parse_with_quick`)."""
    p.add_argument("--quick", action="store_true", default=None, help=f"{what} (the smoke test): QUICK's values "
                   "become the defaults; the reproduce command spells them out")


def split_sections(p: argparse.ArgumentParser, args: argparse.Namespace, known: Sequence[str]) -> None:
    """Turn `--sections a,b` into a list, refusing (parser error, exit 2) names not in `known`."""
    args.sections = [s for s in args.sections.split(",") if s]
    if not args.sections or any(s not in known for s in args.sections):
        p.error(f"--sections must be a comma-separated subset of {','.join(known)}")


def parse_with_quick(p: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: dict[str, Any],
                     sections: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse `argv`; with `--quick`, `quick`'s values become the defaults (options given explicitly
    still win). `args.quick` is then cleared: the reproduce command spells out every value instead.
    With `sections`, `--sections` is split and checked against them."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    args.quick = None
    if sections is not None:
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
        if value == "" or value == []:
            continue  # an empty option is its default
        if isinstance(action, argparse._StoreTrueAction):  # a switch: named when on
            words += [action.option_strings[0]] if value else []
            continue
        if isinstance(action, argparse._AppendAction):  # repeated: once per value
            words += [f"{action.option_strings[0]} {shlex.quote(str(v))}" for v in value]
            continue
        if action.dest == "sections":
            value = shlex.quote(",".join(value))
        elif isinstance(value, (list, tuple)):
            value = " ".join(shlex.quote(str(v)) for v in value)
        else:
            value = shlex.quote(str(value))
        words.append(f"{action.option_strings[0]} {value}")
    return " ".join(words)


def header(module: str, command: str) -> str:
    """The exact command, torch version and threads."""
    return (f"# {module} — torch {torch.__version__}, {os.cpu_count()} CPUs, parent threads "
            f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
            f"each rank 1 thread, gloo over local TCP\n# command: {command}")


def timed(module: str, command: str, out: Callable[[str], None], body: Callable[[], Any]) -> Any:
    """The header, `body()`, then the total seconds, the load average around it and the reproduce command."""
    out(header(module, command))
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = body()
    out(f"\ntotal {time.perf_counter() - start:.1f} s; 1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} "
        f"after (ours counts for up to 2 of it); reproduce: {command}")
    return result


def run_sections(sections: Sequence[tuple[str, Section]], args: argparse.Namespace, command: str,
                 module: str, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections (`args.sections`) in order, each timed; returns their rows by name (for tests)."""
    def body() -> dict[str, Any]:
        result = {}
        for name, fn in sections:
            if name in args.sections:
                t = time.perf_counter()
                result[name] = fn(args, out)
                out(f"({name}: {time.perf_counter() - t:.1f} s)")
        return result

    return timed(module, command, out, body)


def run_one(section: Section, args: argparse.Namespace, command: str, module: str,
            out: Callable[[str], None] = print) -> Any:
    """Run a benchmark of one section; returns its rows (for tests)."""
    return timed(module, command, out, lambda: section(args, out))


def models_main(module: str, p: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: dict[str, Any],
                section: Section) -> int:
    """The `main` of a one-section benchmark over `--models`: parse (with `--quick`), refuse an unknown
    model, run and print; exit status 0."""
    args = parse_with_quick(p, argv, quick)
    check_models(p, *args.models)
    run_one(section, args, reproduce_command(module, p, args), module)
    return 0


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table: columns padded to their widest cell, numbers right-aligned."""
    cells = [[str(c) for c in columns]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if NUMBER.match(c) else c.ljust(w) for c, w in zip(r, widths)) + " |"

    return [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]]


def verdict(ok: Optional[bool]) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")
