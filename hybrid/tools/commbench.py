"""hybrid-commbench: nccl-tests-style bandwidth tables over the world or the groups of a training layout,
and a preflight sniff test of every rank and link.

    torchrun --nproc-per-node 4 -m hybrid.tools.commbench -o all_reduce,all_gather -b 8 -e 64M -f 4
    torchrun --nproc-per-node 8 -m hybrid.tools.commbench parallel=tp2pp2 -o all -e 16M --groups tp,dp
    torchrun --nproc-per-node 8 -m hybrid.tools.commbench model=gpt-1b parallel=tp2pp4 --preflight

Options (nccl-tests' letters):
  -o, --op OPS          comma list of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast,
                        send_recv, or all (default all_reduce)
  -b, --minbytes SIZE   smallest message (default 8); sizes take K, M, G suffixes (powers of 1024)
  -e, --maxbytes SIZE   largest message (default 32M)
  -f, --stepfactor N    multiply the size by N from -b up to -e (default 2, at least 2)
  -d, --datatype TYPE   float32 (default), float64, float16, bfloat16, int32, int64, int8
  -w, --warmup_iters N  untimed calls per size and column (default 5)
  -n, --iters N         timed calls per size and column (default 20)
  -c, --check 0|1       compare every result with the expected one: the #wrong column (default 1)
  --groups KINDS        comma list of world, tp, dp, pp, dp_intra, dp_inter (default: world without a
                        layout; every kind of the layout with more than one rank with one)
  --preflight           the sniff test instead of the tables (all-reduces, ring links, GEMMs)
  --threshold PCT       preflight: flag a rank or link more than PCT% slower than the median (default 20)
  --save FILE           preflight: also write its figures as JSON (a training run's health.comm_preflight)
  --timeout S           seconds before a collective that does not complete fails (default 300)
  --soak DURATION       the acceptance test: every op over every group kind back to back at -e bytes for
                        DURATION (90, 90s, 10m, 2h); calls, wrong results, errors and the slowest calls per
                        group kind and op (docs/commbench.md)
  --backend NAMES       gloo, nccl or gloo,nccl (both, side by side on the same sizes); default: NCCL with
                        CUDA, else gloo
  -h, --help            this text

Words without a leading dash are the trainer's Hydra overrides (`parallel=tp2pp2`, `parallel.tp=2`,
`parallel.ranks_per_node=2`, `model=gpt-1b`): the config is composed and validated as `hybrid.train`
does, and the tables run over the groups the trainer would build. Run under torchrun (gloo on CPU,
NCCL on cuda:LOCAL_RANK when CUDA is present); one process alone is a world of one, where only the
preflight's GEMM has something to measure. Rank 0 prints. Exit status: 0 ok; 1 when a result was
wrong or the preflight flagged something; 2 on bad input (one `hybrid: error: ...` line per rank).
See docs/commbench.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from hybrid import cli
from hybrid.cli import EXIT_FAILED, EXIT_OK, UsageError, env_int
from hybrid.config import ConfigError, compose_config
from hybrid.diagnostics import DiagnosticsError, bandwidth_table
from hybrid.diagnostics import bandwidth as bw
from hybrid.diagnostics import preflight as pf
from hybrid.diagnostics import soak as sk
from hybrid.parallel.context import Layout, LayoutError, ParallelContext
from hybrid.tools.commbench_backends import compare, parse_backends, process_group
from hybrid.validation import validate

KINDS = ("world", "tp", "dp", "pp", "dp_intra", "dp_inter")
SIZE = re.compile(r"^(\d+)\s*([KMG]?)(I?B)?$", re.IGNORECASE)
UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhSMH]?)$")
NOTHING = "# nothing to measure: every group has a single rank (run under torchrun --nproc-per-node N)"
Emit = Callable[[str], None]


@dataclass
class Options:
    """The parsed command line."""

    ops: list[str]
    minbytes: int = 8
    maxbytes: int = 32 * 1024 ** 2
    stepfactor: int = 2
    datatype: str = "float32"
    warmup_iters: int = 5
    iters: int = 20
    check: bool = True
    groups: Optional[list[str]] = None
    preflight: bool = False
    threshold: float = 20.0
    save: Optional[str] = None  # the preflight's figures as JSON
    timeout: float = 300.0
    soak: Optional[float] = None  # seconds
    backends: list[str] = field(default_factory=list)  # [] = the default (commbench_backends.process_group)
    overrides: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """What a run found: the exit status, rank 0's report and the tables (each rank's own groups)."""

    code: int
    text: str
    tables: list[bw.Table] = field(default_factory=list)
    preflight: Optional[pf.Report] = None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_size(text: str) -> int:
    """Bytes of `8`, `64K`, `1M`, `2G`, `16KB`, `4MiB` (K, M, G are powers of 1024); must be > 0."""
    m = SIZE.match(text.strip())
    if not m or int(m.group(1)) <= 0:
        raise UsageError(f"size must be a positive number of bytes with an optional K, M or G suffix, got {text!r}")
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def _parser() -> _Parser:
    p = _Parser(prog="hybrid-commbench", add_help=False, allow_abbrev=False)
    p.add_argument("-o", "--op", default="all_reduce")
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="32M")
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-d", "--datatype", default="float32")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1)
    p.add_argument("--groups")
    p.add_argument("--preflight", action="store_true")
    p.add_argument("--threshold", type=float)
    p.add_argument("--save")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--soak")
    p.add_argument("--backend")
    return p


def _split(text: str, known: tuple[str, ...], what: str) -> list[str]:
    words = [w.strip() for w in text.split(",") if w.strip()]
    words = list(known) if words == ["all"] else words
    bad = [w for w in words if w not in known]
    if bad or not words:
        raise UsageError(f"unknown {what} {', '.join(map(repr, bad or [text]))}; expected a comma list of "
                         f"{', '.join(known)}" + (" or all" if what == "op" else ""))
    return words


def parse_args(argv: list[str]) -> Options:
    """The command line as Options; raises UsageError (one line) on anything wrong."""
    a, rest = _parser().parse_known_args(argv)
    flags = [w for w in rest if w.startswith("-")]
    if flags:
        raise UsageError(f"unrecognized argument {flags[0]!r} (see -h)")
    bw.dtype_of(a.datatype)  # DiagnosticsError on an unknown dtype
    minbytes, maxbytes = parse_size(a.minbytes), parse_size(a.maxbytes)
    if minbytes > maxbytes:
        raise UsageError(f"-b {a.minbytes} ({minbytes} B) is larger than -e {a.maxbytes} ({maxbytes} B)")
    if a.stepfactor < 2:
        raise UsageError(f"-f must be an integer >= 2, got {a.stepfactor}")
    if a.iters < 1 or a.warmup_iters < 0:
        raise UsageError(f"need -n >= 1 and -w >= 0, got -n {a.iters} -w {a.warmup_iters}")
    if a.timeout <= 0 or (a.threshold is not None and (not a.preflight or a.threshold <= 0)):
        raise UsageError("--threshold needs --preflight and a value > 0; --timeout must be > 0")
    if a.save is not None and (not a.preflight or not Path(a.save).parent.is_dir()):
        raise UsageError(f"--save {a.save}: writes the preflight's figures, so it needs --preflight and a folder that "
                         "exists")
    if a.soak is not None and a.preflight:
        raise UsageError("--soak and --preflight are two different runs: choose one")
    groups = _split(a.groups, KINDS, "group kind") if a.groups is not None else None
    return Options(ops=_split(a.op, bw.OPS, "op"), minbytes=minbytes, maxbytes=maxbytes, stepfactor=a.stepfactor,
                   datatype=a.datatype, warmup_iters=a.warmup_iters, iters=a.iters, check=bool(a.check),
                   groups=groups, preflight=a.preflight, threshold=20.0 if a.threshold is None else a.threshold,
                   save=a.save, timeout=a.timeout, soak=None if a.soak is None else parse_duration(a.soak),
                   backends=parse_backends(a.backend, torch.cuda.is_available()), overrides=rest)


def parse_duration(text: str) -> float:
    """Seconds of `90`, `90s`, `10m`, `2h`; must be > 0."""
    m = DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--soak must be a positive duration such as 90, 90s, 10m or 2h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2).lower()]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else env_int("WORLD_SIZE", 1)


def resolve_layout(opts: Options) -> Optional[Layout]:
    """The trainer's layout for the overrides (compose + validate, as hybrid.train), or None without any."""
    if not opts.overrides:
        if opts.groups and set(opts.groups) - {"world"}:
            raise UsageError(f"--groups {','.join(opts.groups)} needs a layout (e.g. parallel=tp2pp2 or parallel.tp=2)")
        return None
    try:
        cfg = compose_config(opts.overrides)
    except Exception as e:  # noqa: BLE001  (any composition failure is bad input)
        raise UsageError(cli.one_line(e)) from None
    layout = validate(cfg, world_size(), env_int("LOCAL_WORLD_SIZE", world_size()))
    try:
        layout_groups(layout)  # an uneven split of DP over nodes fails here, before any group exists
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return layout


def layout_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group's ranks, by kind, as `Layout` (and so `ParallelContext.build`) lays them out."""
    return {"world": [list(range(layout.world))], "tp": layout.tp_groups(), "dp": layout.dp_groups(),
            "pp": layout.pp_groups(), "dp_intra": layout.dp_intra_node_groups(),
            "dp_inter": layout.dp_inter_node_groups()}


def group_sets(opts: Options, layout: Optional[Layout]) -> tuple[list[bw.GroupSet], list[str]]:
    """The group kinds to measure (this rank's process group of each) and a note per kind left out: groups
    of one rank, or the same groups as a kind before. Collective with a layout: `ParallelContext.build`
    creates every group on every rank."""
    world = dist.get_world_size()
    lists = layout_groups(layout) if layout else {"world": [list(range(world))]}
    ctx = ParallelContext.build(layout) if layout else None
    chosen, notes, seen = [], [], {}
    for kind in opts.groups or ([k for k in KINDS if k != "world"] if layout else ["world"]):
        ranks = tuple(tuple(g) for g in lists[kind])
        if len(ranks[0]) == 1:
            notes.append(f"# {kind}: groups of 1 rank, nothing crosses a link")
        elif ranks in seen:
            notes.append(f"# {kind}: the same groups as {seen[ranks]}, measured there")
        else:
            seen[ranks] = kind
            chosen.append(bw.GroupSet(kind, ranks, getattr(ctx, f"{kind}_group") if ctx and kind != "world" else None))
    return chosen, notes


def section_header(g: bw.GroupSet) -> str:
    shown = " ".join(str(list(r)) for r in g.ranks[:8]) + (" …" if len(g.ranks) > 8 else "")
    return f"#\n# ===== {g.kind}: {len(g.ranks)} group(s) of {g.size} ranks: {shown}"


def bench(opts: Options, layout: Optional[Layout], device: torch.device, emit: Emit) -> Outcome:
    """Every op over every chosen group kind, each table emitted as soon as it is complete; exit status 1
    when any element came back wrong."""
    lines: list[str] = []

    def out(text: str) -> None:
        lines.append(text)
        emit(text)

    sets, notes = group_sets(opts, layout)
    dtype, sizes = bw.dtype_of(opts.datatype), bw.sizes(opts.minbytes, opts.maxbytes, opts.stepfactor)
    out(f"# hybrid-commbench: world {dist.get_world_size()} ({_backend_on(device)} on {device.type}), "
        f"{opts.iters} iterations after {opts.warmup_iters} warm-up, check {'on' if opts.check else 'off'}; "
        f"time: mean over ranks, algbw and busbw: from the slowest rank")
    for line in (layout.rank_map().splitlines() if layout else []):
        out("# " + line)
    for note in notes if sets else [*notes, NOTHING]:
        out(note)
    tables = []
    for g in sets:
        out(section_header(g))
        for op in opts.ops:
            tables.append(bw.measure(op, g, sizes, dtype, device, opts.warmup_iters, opts.iters, opts.check))
            out(bandwidth_table.render(tables[-1]))
    wrong = sum(t.wrong for t in tables)
    if wrong:
        out(f"# FAILED: {wrong} wrong element(s) in all (see the #wrong columns)")
    return Outcome(EXIT_FAILED if wrong else EXIT_OK, "\n".join(lines), tables)


def soak(opts: Options, layout: Optional[Layout], device: torch.device, emit: Emit) -> Outcome:
    """`--soak`: every op over every group kind at -e bytes for the duration (hybrid.diagnostics.soak)."""
    sets, notes = group_sets(opts, layout)
    if not sets:
        text = "\n".join([*notes, NOTHING])
        emit(text)
        return Outcome(EXIT_OK, text)
    result = sk.soak(sets, opts.ops, opts.maxbytes, bw.dtype_of(opts.datatype), device, opts.soak or 0.0, opts.check)
    text = sk.render(result, dist.get_world_size(), _backend_on(device), device, opts.soak or 0.0, opts.check)
    emit(text)
    return Outcome(EXIT_FAILED if result.failed else EXIT_OK, text)


def _backend_on(device: torch.device) -> str:
    """The backend that carries this device's tensors: NCCL the GPU's, gloo the CPU's (`--backend`)."""
    return "nccl" if device.type == "cuda" else "gloo"


def preflight(opts: Options, device: torch.device, emit: Emit) -> Outcome:
    report = pf.run_preflight(device, opts.threshold)
    text = pf.render(report, _backend_on(device), device)
    emit(text)
    code = EXIT_OK if report.healthy else EXIT_FAILED
    if opts.save and dist.get_rank() == 0:
        try:
            Path(opts.save).write_text(json.dumps(pf.figures(report), indent=1) + "\n")
        except OSError as e:  # measured, but not kept: one line, and the status says so
            emit(f"preflight: --save {opts.save} not written: {e}")
            code = EXIT_FAILED
    return Outcome(code, text, preflight=report)


def execute(argv: list[str], emit: Emit = lambda text: None) -> Outcome:
    """Parse, validate, measure; `emit` gets the report as it grows. Bad input raises (UsageError,
    ConfigError, DiagnosticsError) before any process group is touched, so every rank fails alike."""
    opts = parse_args(argv)
    layout = resolve_layout(opts)
    with process_group(opts.timeout, opts.backends) as devices:
        if opts.preflight:
            return preflight(opts, devices[0], emit)
        outcomes = [(soak if opts.soak else bench)(opts, layout, device, emit) for device in devices]
        if len(outcomes) == 2 and not opts.soak:
            emit(compare(outcomes[0].tables, outcomes[1].tables, opts.backends))
        return Outcome(max(o.code for o in outcomes), "\n".join(o.text for o in outcomes),
                       [t for o in outcomes for t in o.tables])


def run(argv: Optional[list[str]] = None) -> int:
    """The command line on this rank: rank 0 prints the report; bad input is one line per rank and 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in cli.HELP for a in argv):
        print(__doc__.strip())
        return EXIT_OK
    try:
        outcome = execute(argv, _print if env_int("RANK", 0) == 0 else lambda text: None)
    except (ConfigError, DiagnosticsError) as e:
        cli.say(cli.error_line(str(e)))
        cli.wait_for_peers_to_report()
        return cli.EXIT_BAD_INPUT
    return outcome.code


def _print(text: str) -> None:
    print(text, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point (`hybrid-commbench`)."""
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
