"""Print (and optionally plot) a pipeline schedule as the simulator replays it.

    python -m hybrid.tools.schedule pp=4 microbatches=8 schedule=interleaved virtual_stages=2
    python -m hybrid.tools.schedule pp=4 m=8 schedule=1f1b backward=2 comm=0.1 png=1f1b.png
    python -m hybrid.tools.schedule pp=4 m=8 schedule=zbv v=2 weight=1
    python -m hybrid.tools.schedule pp=4 m=8 schedule=zb1p deferrals=0,1,1,unsplit

Keys (key=value, like Hydra overrides): schedule (gpipe | 1f1b | interleaved | zb1p | zbv), pp, microbatches
(alias m), virtual_stages (alias v), forward, backward, weight, comm (virtual-clock costs: forward/backward of one
microbatch through a whole rank, the weight-gradient share of that backward under a split backward (default
half), comm per p2p batch), forward_only (true | false), png (write a Gantt chart there),
deferrals (zb1p, zbv: per rank the most weight passes left waiting, or `unsplit`, comma-separated — what
`parallel.zb_memory=1f1b` fits and the start-up line prints).
Bad input is one `hybrid: error: ...` line on stderr and exit status 2.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool
from hybrid.parallel.pp.schedules import Action, Op, ScheduleError, build_schedule, steps
from hybrid.parallel.pp.simulator import Simulation, simulate
from hybrid.tools.keys import boolean, key_values

ALIASES = {"m": "microbatches", "v": "virtual_stages"}
INTS = ("pp", "microbatches", "virtual_stages")
FLOATS = ("forward", "backward", "weight", "comm")
KEYS = ("schedule", *INTS, *FLOATS, "forward_only", "png", "deferrals")


@dataclass
class Options:
    """The parsed command line."""

    schedule: str = "1f1b"
    pp: int = 4
    microbatches: int = 8
    virtual_stages: int = 1
    forward: float = 1.0
    backward: float = 2.0
    weight: float | None = None  # the split backward's W share of `backward`; None: half
    comm: float = 0.0
    forward_only: bool = False
    png: str | None = None
    deferrals: list[int | None] | None = None  # per rank; None = unsplit


def parse_args(argv: list[str]) -> Options:
    """Turn `key=value` words into Options; raise UsageError on anything else."""
    opts = Options()
    for key, value in key_values(argv, KEYS, ALIASES, " (m= and v= are aliases)").items():
        setattr(opts, key, _convert(key, value))
    if opts.forward <= 0 or opts.backward <= 0 or opts.comm < 0:
        raise UsageError(f"need forward > 0, backward > 0, comm >= 0, got {opts.forward}, {opts.backward}, {opts.comm}")
    if opts.weight is not None and not 0 <= opts.weight <= opts.backward:
        raise UsageError(f"need 0 <= weight <= backward, got weight={opts.weight:g}, backward={opts.backward:g}")
    return opts


def _convert(key: str, value: str) -> str | int | float | bool | list[int | None]:
    """The typed value of one key."""
    try:
        if key in INTS:
            return int(value)
        if key in FLOATS:
            return float(value)
    except ValueError:
        kind = "an integer" if key in INTS else "a number"
        raise UsageError(f"{key} must be {kind}, got {value!r}") from None
    if key == "forward_only":
        return boolean(key, value)
    if key == "deferrals":
        return _deferrals(value)
    if key == "png" and not value:
        raise UsageError("png= needs a file name")
    return value


def _deferrals(value: str) -> list[int | None]:
    """`0,1,unsplit,2` → [0, 1, None, 2]."""
    try:
        return [None if w.strip() == "unsplit" else int(w) for w in value.split(",")]
    except ValueError:
        raise UsageError(f"deferrals must be comma-separated integers or 'unsplit', got {value!r}") from None


def label(a: Action, v: int) -> str:
    """`F3` / `B3`; with v > 1 a chunk letter follows: `F3a` is chunk 0, `F3b` chunk 1, …"""
    suffix = "" if v == 1 else chr(ord("a") + a.chunk) if a.chunk < 26 else f"c{a.chunk}"
    return f"{a.op}{a.mb}{suffix}"


def cell_size(sim: Simulation) -> float:
    """The timeline's cell: the shortest compute action."""
    return min(end - start for _, start, end, _ in sim.intervals)


def render_timeline(sim: Simulation) -> str:
    """One row per pipeline rank; each compute action fills round(duration / cell) cells (its label, then
    `-` for the rest) from round(start / cell) on, idle cells are `.`, all cells equally wide so columns line up."""
    v, cell = sim.schedule.virtual_stages, cell_size(sim)
    width = max(len(label(a, v)) for *_, a in sim.intervals)
    rows: list[list[str]] = [[] for _ in range(sim.schedule.pp)]
    for r, start, end, a in sim.intervals:  # each rank's intervals come in time order
        first = max(_round(start / cell), len(rows[r]))  # never over the previous action (rounding with comm > 0)
        n = max(1, _round((end - start) / cell))
        rows[r] += ["."] * (first - len(rows[r])) + [label(a, v)] + ["-" * width] * (n - 1)
    ncells = max([_round(sim.makespan / cell)] + [len(row) for row in rows])
    rows = [row + ["."] * (ncells - len(row)) for row in rows]
    pad = len(f"rank {sim.schedule.pp - 1}")
    lines = [f"{f'rank {r}':<{pad}} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows)]
    chunks = "; the letter after the microbatch is the chunk (a = chunk 0, b = chunk 1, …)" if v > 1 else ""
    legend = (f"legend: one cell = {cell:.4g} time units; F<mb> forward, B<mb> backward (split: I<mb> input "
              f"gradient, W<mb> weight gradient){chunks}; "
              f"'-' continues the action to its left; '.' idle")
    return "\n".join([legend, *lines])


def _round(x: float) -> int:
    """Round half up (Python's round() sends 2.5 to 2 but 3.5 to 4)."""
    return math.floor(x + 0.5)


def analytic_bubble(sim: Simulation) -> float:
    """(p − 1) / (v·m + p − 1): the bubble of 1F1B/GPipe (v = 1) and interleaved 1F1B, without comm cost."""
    s = sim.schedule
    return (s.pp - 1) / (s.virtual_stages * s.microbatches + s.pp - 1)


def analytic_line(sim: Simulation, opts: Options) -> str:
    """The closed form next to the simulated bubble: (p−1)/(v·m+p−1), or for zb1p the zero-bubble paper's
    idle (p−1)(F+I−W) per rank over m(F+I+W) of work (exact while W ≤ F and W ≤ I); zbv has none."""
    s = sim.schedule
    p, m, v = s.pp, s.microbatches, s.virtual_stages
    if s.name == "zbv":
        return "analytic: none in closed form (see the simulated figure)"
    if s.deferrals:
        return "analytic: for zb1p's own order only (see the simulated figure)"
    if s.name != "zb1p":
        return f"analytic (p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1} = {analytic_bubble(sim):.4f}"
    w = opts.backward / 2 if opts.weight is None else opts.weight
    f, i = opts.forward, opts.backward - w
    idle = (p - 1) * (f + i - w)
    return (f"analytic (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)) = {idle / (m * (f + i + w) + idle):.4f}"
            + ("" if w <= min(f, i) else " (holds for W <= F and W <= I only)"))


def render_report(sim: Simulation, opts: Options) -> str:
    """The header, the timeline, the bubble, the peak in-flight activations and the deadlock check."""
    s = sim.schedule
    p, m, v = s.pp, s.microbatches, s.virtual_stages
    header = (f"schedule={s.label} pp={p} microbatches={m} virtual_stages={v} "
              f"forward_only={str(opts.forward_only).lower()}  costs: forward={opts.forward:g} "
              f"backward={opts.backward:g} comm={opts.comm:g} (per microbatch through a whole rank"
              + (f"; a chunk costs 1/{v} of that)" if v > 1 else ")"))
    per_rank = "  ".join(f"r{r} {b:.4f}" for r, b in enumerate(sim.bubble_per_rank))
    note = "; analytic ignores comm" if opts.comm else ""
    bubble = (f"bubble: {sim.bubble:.4f} simulated (mean over ranks), {analytic_line(sim, opts)}{note}\n"
              f"  per rank: {per_rank}")
    peaks = "  ".join(f"r{r} {n}" + (f" ({n / v:.3g} stages)" if v > 1 else "")
                      for r, n in enumerate(sim.peak_in_flight))
    unit = "chunk-microbatch activations; ÷v = stage-equivalents" if v > 1 else "microbatch activations"
    freed = " (forward_only: nothing is freed by a backward)" if opts.forward_only else ""
    n_ops = sum(a.op.is_comm for acts in s.actions for a in acts)
    n_batches = sum(isinstance(it, list) for acts in s.actions for it in steps(acts))
    check = (f"deadlock check: order validated and replayed without deadlock under the stream model "
             f"({n_ops} p2p ops in {n_batches} batches on {len(s.streams)} streams, every op matched in FIFO order "
             f"per src→dst channel and stream, each stream's batches completing in order)")
    return "\n".join([header, render_timeline(sim), bubble, f"peak in flight ({unit}){freed}: {peaks}", check])


def write_png(sim: Simulation, path: str) -> None:
    """A Gantt chart: one row per rank, forwards blue and backwards orange, chunks in shades, mb numbers
    (matplotlib imported here: the text report never loads it)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    s = sim.schedule
    fig = Figure(figsize=(min(40.0, max(6.0, 0.25 * len(sim.intervals) / s.pp)), 0.6 * s.pp + 1.2))
    ax = fig.subplots()
    cmaps = {Op.FORWARD: colormaps["Blues"], Op.FULL_BACKWARD: colormaps["Oranges"],
             Op.BACKWARD_INPUT: colormaps["Oranges"], Op.BACKWARD_WEIGHT: colormaps["Greens"]}
    for r, start, end, a in sim.intervals:
        shade = 0.6 if s.virtual_stages == 1 else 0.35 + 0.45 * a.chunk / (s.virtual_stages - 1)
        ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=cmaps[a.op](shade), edgecolor="white")
        ax.text((start + end) / 2, r, str(a.mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (blue forward, orange backward or input gradient, green weight gradient; darker = later "
                  "chunk; text = microbatch)")
    ax.set_title(f"{s.name} pp={s.pp} m={s.microbatches} v={s.virtual_stages}: bubble {sim.bubble:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(opts: Options) -> str:
    """Build, validate and simulate the schedule; write the png if asked; return the report."""
    sched = build_schedule(opts.schedule, opts.pp, opts.microbatches, opts.virtual_stages, opts.forward_only,
                           opts.deferrals)
    sim = simulate(sched, opts.forward, opts.backward, opts.comm, opts.weight)
    report = render_report(sim, opts)
    if opts.png:
        try:
            write_png(sim, opts.png)
        except OSError as e:
            raise UsageError(f"cannot write png={opts.png}: {e.strerror or e}") from None
        report += f"\nwrote {opts.png}"
    return report


def main(argv: list[str] | None = None) -> int:
    """The command line: print the report and return 0, or one error line and 2 (`hybrid.cli.run_tool`)."""
    return run_tool(__doc__, argv, lambda args: run(parse_args(args)), [((UsageError, ScheduleError), EXIT_BAD_INPUT)])


if __name__ == "__main__":
    sys.exit(main())
