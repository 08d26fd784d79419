"""A logged step's communication figures and time breakdown: the `comm/` and `time/` keys of its record.

Each rank turns its `StepTiming` and the `CommCounter`'s tally into one vector of floats in a fixed order
(`local_vector`); the trainer sums the vectors over the world in the one metrics all-reduce it already
makes, and `record` turns the sums into per-rank means:

- `comm/<group>/<op>/{calls,bytes,s,exposed_s,algbw_gbps,busbw_gbps}`: algbw = bytes / s (the op's time is
  the union of its spans, launch to completion), busbw = algbw · `bus_factor(op, group size)` (nccl-tests'
  definitions). Times include waiting for the slowest peer, as a training step sees them.
- `comm/<group>/{s,exposed_s,busbw_gbps}`: the group's time, the time the training thread waited on it. The
  groups are every kind a rank belongs to, `cp`, and `ps`: the parameter server's pushes (`send`) and replies
  (`recv`, counted by the worker they reach), whose waits are exposed `ps` time.
- `comm/overlap_dp`, `comm/overlap_pp`, `comm/overlap_cp`, `comm/overlap_tp`: 1 − exposed / total over the DP
  groups' gradient sync, over PP's p2p, over CP's ring and over TP's exchanges (`parallel.tp_overlap`: 0 when
  blocking) — the loss's and the compression meter's metrics-only reductions left out.
- `time/{step,data,compute,optimizer,bubble,comm_<group>,other}_s`: compute is forward + backward without
  the exposed waits inside them; the bubble is the part of the PP wait that the schedule itself implies
  (`schedule_idle_s`), the rest is exposed PP communication; optimizer includes gradient write-back and
  clipping; meter is the compression error meter's exact all-reduce (it runs on logged steps only, so it
  is kept out of compute and of the groups' figures); other is the unattributed rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.parallel.collectives import CommCounter, bus_factor
from hybrid.parallel.context import GROUP_KINDS
from hybrid.parallel.dp.data import DP_GROUPS
from hybrid.parallel.timing import StepTiming, union_length

LOSS = "loss"  # the op label of the loss's metrics-only broadcast / mean
METER = "meter"  # the compression error meter's exact all-reduce (logged steps only)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "regather", "all_to_all", "send_fwd", "send_bwd",
       "send_recv", "send", "recv", "ring", LOSS, METER)
GROUPS = (*GROUP_KINDS, "cp", "ps")  # the groups reported: every kind a rank belongs to, context parallelism's and
# the parameter server's (`sync=ps`: the pushes a worker sends, the replies it receives)
PHASES = ("step", "data", "compute", "optimizer", "bubble")
OVERLAPPED = ("dp", "pp", "cp", "tp")  # the `comm/overlap_<name>` figures (dp: every DP group)
PER_OP, PER_GROUP = 4, 3  # `local_vector`'s floats per (group, op): calls, bytes, s, exposed; then per group: s,
# exposed, meter


def local_vector(t: StepTiming, counter: CommCounter, idle_s: float) -> list[float]:
    """This rank's figures in the fixed order `record` reads (sum it over the world first).
    `idle_s` is the schedule's own idle time for this rank (`schedule_idle_s`)."""
    out: list[float] = []
    for g in GROUPS:
        for op in OPS:
            out += [counter.calls.get((g, op), 0), counter.bytes.get((g, op), 0), t.op_s.get((g, op), 0.0),
                    t.exposed_op_s.get((g, op), 0.0)]
        out += [t.group_s.get(g, 0.0), t.exposed_s.get(g, 0.0), t.exposed_op_s.get((g, METER), 0.0)]
    out += [*_share(t, DP_GROUPS), *(x for name in OVERLAPPED[1:] for x in _share(t, (name,)))]
    pp_wait = t.exposed_s.get("pp", 0.0)
    compute = sum(t.phase_s.get(k, 0.0) for k in ("forward", "backward", "weight"))
    optimizer = t.phase_s.get("finalize", 0.0) + t.phase_s.get("optimizer", 0.0)
    return out + [t.step_s, t.phase_s.get("data", 0.0), compute, optimizer, min(idle_s, pp_wait)]


def _share(t: StepTiming, groups: Sequence[str]) -> list[float]:
    """(total, exposed) of the groups' traffic without the loss's and the meter's metrics-only reductions."""
    spans = [iv for (g, op), ivs in t.intervals.items() if g in groups and op not in (LOSS, METER) for iv in ivs]
    exposed = sum(s for (g, op), s in t.exposed_op_s.items() if g in groups and op not in (LOSS, METER))
    return [union_length(spans), exposed]


def record(sums: Sequence[float], world: int, sizes: dict[str, int]) -> dict[str, float]:
    """The `comm/` and `time/` keys from `local_vector`s summed over `world` ranks (means per rank);
    `sizes` gives each group's number of ranks (for the bus-bandwidth factor)."""
    v = [x / world for x in sums]
    out: dict[str, float] = {}
    exposed: dict[str, float] = {}
    meter = 0.0
    i = 0
    for g in GROUPS:
        wire = 0.0
        for op in OPS:
            calls, nbytes, s, exp = v[i: i + PER_OP]
            i += PER_OP
            out.update(_op_keys(f"comm/{g}/{op}", calls, nbytes, s, exp, bus_factor(op, sizes.get(g, 1))))
            wire += nbytes * bus_factor(op, sizes.get(g, 1))
        s, exp, met = v[i: i + PER_GROUP]
        i += PER_GROUP
        exposed[g], meter = exp - met, meter + met
        if s or exp:
            out.update({f"comm/{g}/s": s, f"comm/{g}/exposed_s": exp})
            if s and wire:
                out[f"comm/{g}/busbw_gbps"] = wire / s / 1e9
    for name in OVERLAPPED:
        out.update(_overlap(name, v[i], v[i + 1]))
        i += 2
    return out | _breakdown(v[i: i + len(PHASES)], exposed, meter)


def _op_keys(prefix: str, calls: float, nbytes: float, s: float, exposed: float, factor: float) -> dict[str, float]:
    if not calls and not s:
        return {}
    out = {f"{prefix}/calls": calls, f"{prefix}/bytes": nbytes} if calls else {}
    out |= {key: x for key, x in ((f"{prefix}/s", s), (f"{prefix}/exposed_s", exposed)) if x}
    if s and nbytes:
        out[f"{prefix}/algbw_gbps"] = nbytes / s / 1e9
        out[f"{prefix}/busbw_gbps"] = nbytes / s / 1e9 * factor
    return out


def _overlap(name: str, total: float, exposed: float) -> dict[str, float]:
    if not total:
        return {}
    hidden = total - exposed  # below a rounding error of `total`: nothing was hidden
    return {f"comm/overlap_{name}": hidden / total if hidden > 1e-9 * total else 0.0}


def _breakdown(phases: Sequence[float], exposed: dict[str, float], meter: float) -> dict[str, float]:
    """Where the step went: data, compute, optimizer, bubble, each group's exposed communication, the
    compression meter (logged steps only), and the unattributed rest."""
    step, data, compute, optimizer, bubble = phases
    comm = {g: s - (bubble if g == "pp" else 0.0) for g, s in exposed.items() if s}
    parts = {"data": data, "compute": compute, "optimizer": optimizer, "bubble": bubble,
             **{f"comm_{g}": s for g, s in comm.items()}, **({"meter": meter} if meter else {})}
    out = {"time/step_s": step, **{f"time/{k}_s": s for k, s in parts.items()}}
    out["time/other_s"] = step - sum(parts.values())
    return out


def group_seconds(local: Sequence[float]) -> list[float]:
    """Each group's seconds (in `GROUPS`' order) in one rank's `local_vector`."""
    block = PER_OP * len(OPS) + PER_GROUP
    return [local[i * block + PER_OP * len(OPS)] for i in range(len(GROUPS))]
