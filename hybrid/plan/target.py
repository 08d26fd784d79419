"""Bandwidth planning (`hybrid-plan --target`): for each planned layout, the link speed at which its predicted step
reaches a target — the links between nodes, or inside the node on one node — and what a compressed DP exchange
(int8 across nodes, `exchange`) does instead: its step over today's links, and the break-even speed below which it
is the faster exchange (the compression bench's break-even, per layout).

Each answer re-predicts the layout with only that link changed, the DP exchange re-chosen at every speed (the
fastest exact one). A speed is searched between 1/1000 and 1000 times today's by bisection on its logarithm; a
target no speed in that range reaches is said so, with the step an infinitely fast link would leave (compute,
bubble, optimizer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Optional

from hybrid.plan.cost import Shape
from hybrid.plan.hardware import Cluster, Link, PlanError
from hybrid.plan.predict import Candidate, Prediction, exchange_seconds, predict

SPAN = 1000.0  # speeds searched: today's / SPAN … today's × SPAN
UNITS = {"s": "step", "tok/s": "cluster", "tok/s/gpu": "gpu"}
PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|tok/s|tok/s/gpu)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Target:
    step_s: float  # the step time that meets it
    text: str  # as the user gave it


@dataclass(frozen=True)
class Answer:
    """One layout against the target; speeds in GB/s (bus bandwidth per rank), None where none in range does."""

    label: str
    step_s: float
    meets: bool
    link: str  # inter (between nodes) | intra (inside the one node)
    now_gbps: float
    needed_gbps: Optional[float]
    unlimited_s: float  # the step with that link infinitely fast
    int8_step_s: Optional[float] = None  # with int8 across nodes over today's links (None: no such exchange)
    int8_pays_below_gbps: Optional[float] = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def parse(text: str, tokens_per_step: int, world: int) -> Target:
    """`1.5s` (a step), `200000tok/s` (the cluster's tokens a second) or `5000tok/s/gpu`."""
    m = PATTERN.match(text)
    if not m or not float(m.group(1)) > 0:
        raise PlanError(f"--target must be a step time or a throughput like 1.5s, 200000tok/s or 5000tok/s/gpu, "
                        f"got {text!r}")
    value, unit = float(m.group(1)), UNITS[m.group(2).lower()]
    step = value if unit == "step" else tokens_per_step / (value * (world if unit == "gpu" else 1))
    return Target(step, text.strip())


def answer(shape: Shape, p: Prediction, cluster: Cluster, batch: int, seq: int, target: Target) -> Answer:
    """`p`'s layout against `target` (see the module doc)."""
    link = "inter" if cluster.nodes > 1 else "intra"
    now = getattr(cluster, link).busbw
    exact = _stepper(shape, replace(p.candidate, dp_exchange="auto"), cluster, link, batch, seq)
    lossy = replace(p.candidate, dp_exchange="int8")
    has_int8 = "int8" in exchange_seconds(p.candidate, shape, cluster)
    int8 = _stepper(shape, lossy, cluster, link, batch, seq) if has_int8 else None
    return Answer(p.candidate.label(), p.step_s, p.step_s <= target.step_s, link, now / 1e9,
                  _gbps(least_speed(exact, target.step_s, now)), exact(now * SPAN * SPAN),
                  int8(now) if int8 else None, _gbps(break_even(exact, int8, now)) if int8 else None)


def _stepper(shape: Shape, c: Candidate, cluster: Cluster, link: str, batch: int, seq: int
             ) -> Callable[[float], float]:
    """Step seconds of `c` as a function of the bus bandwidth (B/s) of `link`, latency kept."""
    old = getattr(cluster, link)
    return lambda bw: predict(shape, c, replace(cluster, **{link: Link(bw, old.latency)}), batch, seq).step_s


def least_speed(step_of: Callable[[float], float], goal: float, now: float) -> Optional[float]:
    """The least speed (B/s) at which `step_of` is within `goal`; None if not even SPAN × today's."""
    lo, hi = now / SPAN, now * SPAN
    if step_of(hi) > goal:
        return None
    if step_of(lo) <= goal:
        return lo
    return _bisect(lambda bw: step_of(bw) <= goal, lo, hi)


def break_even(exact: Callable[[float], float], lossy: Callable[[float], float], now: float) -> Optional[float]:
    """The speed below which `lossy` is the faster step; None if it is faster (or slower) everywhere in range."""
    lo, hi = now / SPAN, now * SPAN
    faster = lambda bw: lossy(bw) < exact(bw)  # noqa: E731 - a predicate for the bisection
    if not faster(lo) or faster(hi):
        return None
    return _bisect(lambda bw: not faster(bw), lo, hi)


def _bisect(ok: Callable[[float], bool], lo: float, hi: float, steps: int = 40) -> float:
    """The least speed in (lo, hi] where `ok` holds, `ok(lo)` false and `ok(hi)` true, on a log scale."""
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        mid = (a + b) / 2
        a, b = (a, mid) if ok(math.exp(mid)) else (mid, b)
    return math.exp(b)


def _gbps(bw: Optional[float]) -> Optional[float]:
    return None if bw is None else bw / 1e9


def lines(target: Target, answers: list[Answer], tokens_per_step: int) -> list[str]:
    """The target and one line per layout."""
    out = [f"target {target.text}: a step within {target.step_s:.3f} s ({tokens_per_step / target.step_s:,.0f} "
           "tokens/s)"]
    return out + [f"{i:>2} {a.label}: {_speed_text(a)}{_int8_text(a, target)}" for i, a in enumerate(answers, 1)]


def _speed_text(a: Answer) -> str:
    where = "between nodes" if a.link == "inter" else "inside the node"
    verdict = "meets it" if a.meets else "misses it"
    if a.needed_gbps is None:
        return (f"{a.step_s:.3f} s, {verdict}; no link speed {where} reaches it (links infinitely fast: "
                f"{a.unlimited_s:.3f} s)")
    return f"{a.step_s:.3f} s, {verdict}; needs links {where} of ≥ {a.needed_gbps:.1f} GB/s (now {a.now_gbps:.1f})"


def _int8_text(a: Answer, target: Target) -> str:
    if a.int8_step_s is None:
        return ""
    reach = "reaches" if a.int8_step_s <= target.step_s else "misses"
    pays = f", int8 pays off below {a.int8_pays_below_gbps:.1f} GB/s" if a.int8_pays_below_gbps else ""
    return f"; int8 across nodes today: {a.int8_step_s:.3f} s ({reach} it{pays})"
