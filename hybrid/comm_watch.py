"""Communication alerts during a run (`health.comm_*`): each group's bus bandwidth and exposed time against the
run's own settled baseline, so a link that degrades at hour five says so at hour five.

**What is watched.** Every timed logged step's record (`logging.timing`, on by default): the `comm/<group>/...`
keys of `hybrid.record.comm_report`, means over the ranks after the metrics all-reduce — so every rank reads the
same figures, reaches the same verdict, and joins the one collective an alert makes, or none.

**The baseline.** The first `health.comm_warmup` timed records are skipped (compilation, the allocator, the first
buckets); then a group's baseline is the median, figure by figure, of its first `health.comm_baseline` records in
which it communicated (a group that exchanges every H steps is compared on the steps it exchanges). A resumed run
settles a baseline of its own.

**Worse.** A check finds a group worse when its bus bandwidth is below the baseline's / `health.comm_slowdown`, or
its exposed time (the training thread's wait) above the baseline's × `comm_slowdown` — *and* its share of the step
(its time, or its exposed time, over the step's) rose by at least `health.comm_min_share` — and, for the exposed
time, the step itself grew by at least `comm_min_share` of the baseline's: a machine slower as a whole (its compute
too) moves no share, a collective of microseconds cannot matter, and a wait that grew only because faster compute
stopped hiding the same exchange leaves the step as long as it was. A step whose group moved
more than twice, or less than half, the baseline's bytes is another exchange (a DiLoCo fragment, a final sync), not
a slower one, and is not checked; `health.comm_baseline` such steps in a row (the auto compression schedule switched
to a codec) are the group's new baseline.

**An alert.** `health.comm_checks` checks in a row worse is one warning line: the group, the op whose time grew most,
the figure before and now, and the ranks involved — from one all-gather over the world of each rank's seconds in
each group at that step (metrics only, uncounted): the group's instances (every DP group, every pipeline, …) by
their mean time, the slow ones named, or all of them alike (a shared link, the network). The alert is re-armed
once that figure is back within the threshold. `summary.json` lists the alerts (`communication.alerts`);
`health.comm_action=stop` raises `CommDegraded` on every rank after the line, and `hybrid.train` saves the step
reached and exits 1. With `health.comm_preflight` (a `hybrid-commbench --preflight --save FILE` result) each alert
also quotes the preflight's all-reduce bus bandwidth over the world, the figure the cluster had before the run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hybrid.config import ConfigError, HealthConfig
from hybrid.parallel.layout import Layout
from hybrid.record.comm_report import GROUPS, LOSS, METER, OPS, group_seconds

FIGURES = ("busbw", "exposed")
WATCHED_OPS = tuple(op for op in OPS if op not in (LOSS, METER))  # the ops an alert may name


class CommDegraded(RuntimeError):
    """`health.comm_action=stop`: a group's communication stayed worse than its baseline (exit 1, after a save)."""

    def __init__(self, line: str, record: dict[str, Any]) -> None:
        super().__init__(line)
        self.record = record  # the alerting step's metrics record, logged before the run ends


@dataclass(frozen=True)
class Figures:
    """One group's figures at one step (or a baseline's medians): seconds, exposed seconds, bus GB/s, the step's
    seconds, bytes, and each op's seconds."""

    s: float
    exposed: float
    busbw: float
    step: float
    nbytes: float
    ops: dict[str, float] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.s / self.step if self.step else 0.0

    @property
    def exposed_share(self) -> float:
        return self.exposed / self.step if self.step else 0.0


@dataclass(frozen=True)
class Alert:
    step: int
    group: str
    figure: str  # busbw | exposed
    op: str  # the op whose time grew most ("" when none did)
    before: float
    now: float
    ranks: list[list[int]]  # the slow instances of the group, or all of them when alike
    line: str


def figures(record: dict[str, Any], g: str) -> Optional[Figures]:
    """Group `g`'s figures in a timed record, or None where it did not communicate (or the step was not timed)."""
    s, step = record.get(f"comm/{g}/s", 0.0), record.get("time/step_s", 0.0)
    if not s or not step:
        return None
    ops = {op: record.get(f"comm/{g}/{op}/s", 0.0) for op in WATCHED_OPS}
    nbytes = sum(record.get(f"comm/{g}/{op}/bytes", 0.0) for op in OPS)
    return Figures(s, record.get(f"comm/{g}/exposed_s", 0.0), record.get(f"comm/{g}/busbw_gbps", 0.0), step, nbytes,
                   {op: x for op, x in ops.items() if x})


def median_figures(samples: Sequence[Figures]) -> Figures:
    """The baseline: the median of each figure over `samples`."""
    med = statistics.median
    ops = {op for f in samples for op in f.ops}
    return Figures(med([f.s for f in samples]), med([f.exposed for f in samples]), med([f.busbw for f in samples]),
                   med([f.step for f in samples]), med([f.nbytes for f in samples]),
                   {op: med([f.ops.get(op, 0.0) for f in samples]) for op in ops})


def worse(base: Figures, now: Figures, cfg: HealthConfig) -> list[str]:
    """The figures of `now` (the same exchange as `base`'s) worse than `base` by the thresholds (see the module
    doc): "busbw", "exposed"."""
    out = []
    if base.busbw and now.busbw and now.busbw < base.busbw / cfg.comm_slowdown \
            and now.share - base.share >= cfg.comm_min_share:
        out.append("busbw")
    grown = now.step - base.step >= cfg.comm_min_share * base.step  # the step longer, not only less of it hidden
    if now.exposed > base.exposed * cfg.comm_slowdown and now.exposed_share - base.exposed_share >= cfg.comm_min_share \
            and grown:
        out.append("exposed")
    return out


def grown_op(base: Figures, now: Figures) -> str:
    """The op whose seconds grew most from the baseline ("" when none grew)."""
    growth = {op: s - base.ops.get(op, 0.0) for op, s in now.ops.items()}
    op = max(growth, key=lambda o: growth[o], default="")
    return op if op and growth[op] > 0 else ""


def instances(layout: Layout, g: str) -> list[list[int]]:
    """The rank lists of every group of kind `g` (the gradients' "dp" is CP × DP; the parameter server's "ps"
    traffic runs inside each DP group)."""
    if g == "dp" and layout.cp > 1:
        return layout.axis_groups("cp-dp")
    return layout.groups("dp" if g == "ps" else g)


def slow_instances(groups: list[list[int]], seconds: Sequence[float], slowdown: float) -> tuple[list[list[int]], str]:
    """The instances to name, and how they compare: those whose ranks spent more than `slowdown` × the fastest
    instance's mean seconds, or every instance when none stands out (a shared link, the network)."""
    means = [statistics.fmean(seconds[r] for r in ranks) for ranks in groups]
    if len(groups) == 1:
        return groups, f"ranks {groups[0]} (the only such group, {means[0]:.3g} s each)"
    fastest = min(means)
    slow = [i for i, m in enumerate(means) if m > slowdown * fastest]
    if not slow:
        shown = ", ".join(f"{groups[i]} {means[i]:.3g} s" for i in range(min(4, len(groups))))
        return groups, f"all {len(groups)} groups alike ({shown}{', …' if len(groups) > 4 else ''})"
    named = ", ".join(f"{groups[i]} {means[i]:.3g} s" for i in slow)
    return [groups[i] for i in slow], f"ranks {named} against {fastest:.3g} s in the fastest of {len(groups)} groups"


def read_preflight(path: str) -> Optional[dict[str, Any]]:
    """`health.comm_preflight`'s file (None when unset); a missing or unreadable one is a ConfigError."""
    if not path:
        return None
    try:
        doc = json.loads(Path(path).read_text())
        return {"busbw_gbps": float(doc["allreduce"]["busbw_gbps"]), "bytes": int(doc["allreduce"]["bytes"]),
                "world": int(doc["world"])}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"health.comm_preflight: {path} is not a `hybrid-commbench --preflight --save` result "
                          f"({type(e).__name__}: {e})") from None


class CommWatch:
    """The alerts of one rank; `check` every logged record (every rank alike: see the module doc)."""

    def __init__(self, cfg: HealthConfig, layout: Layout, say: Callable[[str], None],
                 gather: Callable[[list[float]], list[list[float]]]) -> None:
        self.cfg, self.layout, self.say, self.gather = cfg, layout, say, gather
        self.preflight = read_preflight(cfg.comm_preflight)
        self.timed = 0  # timed records seen
        self.samples: dict[str, list[Figures]] = {}  # a group's records towards its baseline
        self.base: dict[str, Figures] = {}
        self.streak: dict[tuple[str, str], int] = {}  # (group, figure) → checks in a row worse
        self.alerts: list[Alert] = []

    def check(self, step: int, record: dict[str, Any], local: Optional[Sequence[float]]) -> dict[str, Any]:
        """Check a logged step's record (`local`: this rank's `comm_report.local_vector`, None when untimed);
        returns `health/comm_alerts` once watching. Collective when an alert is due; raises CommDegraded after
        the line under `health.comm_action=stop`."""
        if not self.cfg.comm_checks or local is None or "time/step_s" not in record:
            return {}
        self.timed += 1
        if self.timed <= self.cfg.comm_warmup:
            return {}
        due = [(g, figure, now) for g in GROUPS if (now := figures(record, g)) for figure in self._observe(g, now)]
        if due:
            self._alert(step, due, local, record)
        return {"health/comm_alerts": len(self.alerts)}

    def summary(self) -> dict[str, Any]:
        """summary.json's `communication.alerts` (the alerts' figures and lines)."""
        return {"alerts": [dataclasses.asdict(a) for a in self.alerts]}

    def _observe(self, g: str, now: Figures) -> list[str]:
        """Feed group `g`'s figures to its baseline, or check them against it; the figures whose streak just
        reached `health.comm_checks`."""
        if g not in self.base:
            self._settle(g, now)
            return []
        if not self._same_exchange(g, now):
            return []
        bad, out = worse(self.base[g], now, self.cfg), []
        for figure in FIGURES:
            n = self.streak.get((g, figure), 0) + 1 if figure in bad else 0
            self.streak[(g, figure)] = n
            if n == self.cfg.comm_checks:
                out.append(figure)
        return out

    def _same_exchange(self, g: str, now: Figures) -> bool:
        """Whether `now` moved about the baseline's bytes (within 2×). `health.comm_baseline` other ones in a row
        (the auto compression schedule switched, a mode changed what it sends) are the group's new baseline."""
        base = self.base[g]
        if base.nbytes / 2 <= now.nbytes <= base.nbytes * 2:
            self.samples.pop(g, None)
            return True
        if self._settle(g, now):
            self.streak = {k: n for k, n in self.streak.items() if k[0] != g}
        return False

    def _settle(self, g: str, now: Figures) -> bool:
        """Add `now` to group `g`'s records towards a baseline; with `health.comm_baseline` of them, their medians
        are its baseline (True)."""
        self.samples.setdefault(g, []).append(now)
        if len(self.samples[g]) < self.cfg.comm_baseline:
            return False
        self.base[g] = median_figures(self.samples.pop(g))
        return True

    def _alert(self, step: int, due: list[tuple[str, str, Figures]], local: Sequence[float],
               record: dict[str, Any]) -> None:
        """One line per due (group, figure), naming the ranks from every rank's seconds per group (one all-gather)."""
        rows, first = self.gather(group_seconds(local)), len(self.alerts)
        for g, figure, now in due:
            seconds = [row[GROUPS.index(g)] for row in rows]
            ranks, who = slow_instances(instances(self.layout, g), seconds, self.cfg.comm_slowdown)
            alert = self._describe(step, g, figure, now, ranks, who)
            self.alerts.append(alert)
            self.say(alert.line)
        if self.cfg.comm_action == "stop":
            line = self.alerts[first].line.removeprefix("warning: communication: ")
            raise CommDegraded(f"communication degraded, stopping (health.comm_action=stop): {line}",
                               record | {"health/comm_alerts": len(self.alerts)})

    def _describe(self, step: int, g: str, figure: str, now: Figures, ranks: list[list[int]], who: str) -> Alert:
        base, c = self.base[g], self.cfg
        op = grown_op(base, now)
        what = f"{g}{' ' + op if op else ''}"
        if figure == "busbw":
            before, after = base.busbw, now.busbw
            change = (f"bus bandwidth fell from {before:.3g} to {after:.3g} GB/s ({base.s:.3g} → {now.s:.3g} s, "
                      f"{base.share:.0%} → {now.share:.0%} of the step)")
        else:
            before, after = base.exposed, now.exposed
            change = (f"exposed time rose from {before:.3g} to {after:.3g} s per step ({base.exposed_share:.0%} → "
                      f"{now.exposed_share:.0%} of the step)")
        line = (f"warning: communication: {what} {change}, {c.comm_checks} checks in a row to step {step} "
                f"(health.comm_slowdown={c.comm_slowdown:g}); {who}{self._preflight_note()}")
        return Alert(step, g, figure, op, before, after, ranks, line)

    def _preflight_note(self) -> str:
        p = self.preflight
        if p is None:
            return ""
        return (f"; the preflight measured {p['busbw_gbps']:.3g} GB/s bus bandwidth for a {p['bytes']} B all_reduce "
                f"over {p['world']} ranks")
