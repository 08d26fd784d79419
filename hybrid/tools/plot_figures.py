"""The figures of `hybrid.tools.plot`: pure functions from runs to a matplotlib `Figure` (no pyplot state,
drawn on the Agg canvas when saved). Run i is drawn in colour C<i> in every figure; with `smooth` > 1 a
series is drawn faint as logged and solid as its trailing moving average. A figure whose keys no run has
raises `Skipped` with the reason, which the command line prints as a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybrid.tools.plot_series import Points, Run, group_bytes, moving_average, time_parts

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

X_LABELS = {"step": "step", "tokens": "tokens seen (step × global batch × seq len)"}
GROUP_TITLES = {"dp": "data parallel (gradient sync)", "dp_inter": "data parallel, between nodes",
                "tp": "tensor parallel", "pp": "pipeline (p2p)", "embedding": "tied embedding"}
LOG_SPREAD = 30.0  # a log y axis when a panel's positive values span more than this factor


class Skipped(Exception):
    """A figure that cannot be drawn from these runs (the reason is its message)."""


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def color(i: int) -> str:
    return f"C{i % 10}"


def x_values(run: Run, xs: list[float], x: str) -> list[float]:
    """Steps as they are, or as tokens seen (`Skipped` without the run's tokens per step)."""
    if x == "step":
        return xs
    if run.tokens_per_step is None:
        raise Skipped(f"x=tokens needs {run.folder}/.hydra/config.yaml (train.global_batch_size, data.seq_len)")
    return [s * run.tokens_per_step for s in xs]


def draw(ax: Axes, pts: Points, col: str, label: str, smooth: int, **style: object) -> None:
    """One series: solid as logged, or faint as logged behind its moving average."""
    xs, ys = pts
    if smooth > 1 and len(ys) > 1:
        ax.plot(xs, ys, color=col, alpha=0.25, linewidth=1.0, label="_raw")
        ys = moving_average(ys, smooth)
    ax.plot(xs, ys, color=col, label=label, linewidth=1.6, **style)


def style_x(ax: Axes, x: str) -> None:
    from matplotlib.ticker import EngFormatter

    ax.set_xlabel(X_LABELS[x])
    if x == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(True, alpha=0.3)


def having(runs: Sequence[Run], *keys: str) -> list[tuple[int, Run]]:
    """(colour index, run) of the runs that carry any of `keys`; `Skipped` when none does."""
    out = [(i, r) for i, r in enumerate(runs) if any(r.has(k) for k in keys)]
    if not out:
        raise Skipped(f"no run has {' or '.join(keys)}")
    return out


def title(what: str, smooth: int) -> str:
    return what + (f"\n(lines: moving average over {smooth} points; faint: as logged)" if smooth > 1 else "")


def loss_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """Training loss (solid) and eval loss (dashed, dots) of every run, against steps or tokens."""
    fig = new_figure(8, 4.5)
    ax = fig.subplots()
    for i, run in having(runs, "loss", "eval_loss"):
        if run.has("loss"):
            xs, ys = run.series("loss")
            draw(ax, (x_values(run, xs, x), ys), color(i), run.label, smooth)
        if run.has("eval_loss"):
            xs, ys = run.series("eval_loss")
            label = "_eval" if run.has("loss") else f"{run.label} (eval)"
            ax.plot(x_values(run, xs, x), ys, color=color(i), linestyle="--", marker="o", markersize=4, label=label)
    if any(r.has("eval_loss") for r in runs):  # the two line styles, in the legend after the runs
        ax.plot([], [], color="0.35", label="training")
        ax.plot([], [], color="0.35", linestyle="--", marker="o", markersize=4, label="eval")
    ax.set_ylabel("cross-entropy loss (nats / token)")
    ax.set_title(title("training and eval loss", smooth))
    style_x(ax, x)
    ax.legend(loc="upper right")
    return fig


def throughput_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """Tokens per second of the whole job (global batch · seq len / step time) of every run."""
    fig = new_figure(8, 4.5)
    ax = fig.subplots()
    for i, run in having(runs, "tokens_per_s"):
        xs, ys = run.series("tokens_per_s")
        draw(ax, (x_values(run, xs, x), ys), color(i), run.label, smooth)
    ax.set_ylabel("tokens / s (whole job)")
    ax.set_ylim(bottom=0)
    ax.set_title(title("throughput", smooth))
    style_x(ax, x)
    ax.legend(loc="lower right")
    return fig


def log_if_spread(ax: Axes, values: Sequence[float], zero_based: bool = False) -> None:
    """A log y axis when the positive values span more than LOG_SPREAD, else from 0 if `zero_based`."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > LOG_SPREAD:
        ax.set_yscale("log")
    elif pos and min(values) >= 0 and zero_based:
        ax.set_ylim(bottom=0)


def bytes_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """Bytes each group sent per step (mean per rank), one panel per group, one line per run."""
    per_run = [group_bytes(r) for r in runs]
    groups = [g for g in dict.fromkeys(g for b in per_run for g in b)]
    if not groups:
        raise Skipped("no run has bytes_<group> or comm/<group>/<op>/bytes keys with any traffic")
    fig = new_figure(min(max(5.0 * len(groups), 8.0), 15.0), 4.2)
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, g in zip(axes, groups):
        every: list[float] = []
        for i, (run, b) in enumerate(zip(runs, per_run)):
            if g in b:
                xs, ys = b[g]
                ax.plot(x_values(run, xs, x), [y / 1e6 for y in ys], color=color(i), label=run.label, linewidth=1.6)
                every += [y / 1e6 for y in ys]
        log_if_spread(ax, every, zero_based=True)
        ax.set_title(GROUP_TITLES.get(g, g))
        ax.set_ylabel("MB per step, mean per rank")
        style_x(ax, x)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle("bytes sent per step, per group (every op, counted at the collectives)")
    return fig


def compression_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """The DP gradient sync's compression ratio (exact fp32 ring bytes / sent) and its relative error
    ‖ĝ − g‖ / ‖g‖ (on the metered steps), one panel each, one line per run."""
    keys = [k for k in ("compression_ratio", "compression_error") if any(r.has(k) for r in runs)]
    if not keys:
        raise Skipped("no run has compression_ratio or compression_error (one DP rank, or an older record)")
    fig = new_figure(5.5 * len(keys), 4.2)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    labels = {"compression_ratio": ("compression ratio", "exact fp32 ring bytes / bytes sent (×)"),
              "compression_error": ("compression error", "‖ĝ − g‖ / ‖g‖ of the averaged gradient")}
    for ax, key in zip(axes, keys):
        every: list[float] = []
        for i, run in having(runs, key):
            xs, ys = run.series(key)
            if not any(ys):  # an exact sync: nothing to draw on a log axis, said in the legend
                ax.plot([], [], color=color(i), label=f"{run.label}: 0 (exact)")
                continue
            draw(ax, (x_values(run, xs, x), ys), color(i), run.label, smooth if key.endswith("error") else 1,
                 marker="." if len(xs) < 30 else None)
            every += ys
        log_if_spread(ax, every)
        ax.set_title(labels[key][0])
        ax.set_ylabel(labels[key][1])
        style_x(ax, x)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle("DP gradient compression")
    return fig


def budget_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """The error budget of the first run that has one (`hybrid.record.error_budget`): each DP bucket's compression
    error on the metered steps, and the rank (PowerSGD) or density (top-k, DGC) it spent, one line per bucket."""
    run = next((r for r in runs if any(k.startswith("compression/") for k in r.keys())), None)
    if run is None:
        raise Skipped("no run has per-bucket compression keys (compression/<bucket>/…: a lossy DP exchange)")
    panels = [f for f in ("error", "probe_error", "rank", "density") if any(k.endswith(f"/{f}") for k in run.keys())]
    fig = new_figure(5.5 * len(panels), 4.2)
    for ax, figure in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        keys = sorted(k for k in run.keys() if k.startswith("compression/") and k.endswith(f"/{figure}"))
        for i, key in enumerate(keys):
            xs, ys = run.series(key)
            draw(ax, (x_values(run, xs, x), ys), color(i), key.split("/")[1], smooth if "error" in figure else 1,
                 marker="." if len(xs) < 30 else None)
        ax.set_title(BUDGET_TITLES[figure])
        style_x(ax, x)
        ax.legend(loc="best", fontsize="x-small", ncol=1 + len(keys) // 12)
    fig.suptitle(f"error budget per DP bucket: {run.label}")
    return fig


BUDGET_TITLES = {"error": "‖ĝ − g‖ / ‖g‖ (metered steps)", "probe_error": "PowerSGD's estimated error (its probes)",
                 "rank": "PowerSGD rank (mean over the bucket's matrices)", "density": "share of elements sent"}


def time_figure(runs: Sequence[Run], x: str = "step", smooth: int = 1) -> Figure:
    """Where a step's time went, one stacked horizontal bar per run: the `time/` parts averaged over the
    timed steps after the first; the bar's end is the mean step time."""
    parts = [(i, r, time_parts(r)) for i, r in enumerate(runs)]
    parts = [(i, r, p) for i, r, p in parts if p]
    if not parts:
        raise Skipped("no run has time/ keys (logging.timing=false?)")
    longest = max(sum(max(v, 0.0) for v in p.values()) for _, _, p in parts)
    names = [k for k in dict.fromkeys(k for _, _, p in parts for k in p)
             if any(p.get(k, 0.0) > 1e-3 * longest for _, _, p in parts)]  # parts too thin to see: left out
    fig = new_figure(9, 1.2 + 0.7 * len(parts))
    ax = fig.subplots()
    for row, (_, _run, p) in enumerate(parts):
        left = 0.0
        for k in names:
            width = max(p.get(k, 0.0), 0.0)  # `other` may round below zero
            name = PART_LABELS.get(k, k.replace("comm_", "exposed comm ")) if row == 0 else "_" + k
            ax.barh(row, width, left=left, color=_part_color(names, k), label=name)
            left += width
        total = sum(max(v, 0.0) for v in p.values())
        ax.text(left, row, f" {total:.3g} s", va="center", fontsize="small")
    ax.set_yticks(range(len(parts)), [r.label for _, r, _ in parts])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (mean per rank, first timed step left out)")
    ax.set_title("step time breakdown")
    ax.set_xlim(0, 1.15 * max(sum(max(v, 0.0) for v in p.values()) for _, _, p in parts))  # room for the totals
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(parts)), ncol=min(len(names), 6),
              fontsize="small", frameon=False)
    return fig


PART_LABELS = {"meter": "compression error meter", "bubble": "pipeline bubble", "other": "other (unattributed)"}


def _part_color(names: list[str], part: str) -> str:
    """Fixed colours for the common parts; comm_<group> and the rest from a second palette."""
    fixed = {"compute": "#4C72B0", "data": "#8C8C8C", "optimizer": "#55A868", "bubble": "#C44E52",
             "comm_dp": "#DD8452", "comm_tp": "#8172B3", "comm_pp": "#937860", "meter": "#DA8BC3",
             "other": "#DDDDDD"}
    if part in fixed:
        return fixed[part]
    return f"C{(names.index(part) + 4) % 10}"


FIGURES = {"loss": loss_figure, "throughput": throughput_figure, "bytes": bytes_figure,
           "compression": compression_figure, "budget": budget_figure, "time": time_figure}
"""Each figure's name (the --only word and the PNG's stem) and builder."""
