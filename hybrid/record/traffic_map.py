"""Who sends to whom: a step's counted bytes as rank × rank matrices, one per group.

Each rank fills its own row from the `CommCounter` and the layout's groups, under the ring model the
byte counts already assume (`CommCounter.wire_bytes`): in a ring collective over a group (all-reduce,
all-gather, reduce-scatter) a rank sends its wire bytes to the next rank of the group; in an all-to-all it
sends one n-th of its input to every other member; a pipeline rank sends `send_fwd` to the next stage and
`send_bwd` to the previous one (wrapping around for interleaved chunks). Summing every rank's rows over the
world (one all-reduce, done once per run) gives the whole matrix. NCCL's trees and gloo's own algorithms
route differently; the totals per rank are the same as the ring's.
"""

from __future__ import annotations

from hybrid.parallel.collectives import CommCounter, bus_factor
from hybrid.parallel.context import GROUP_KINDS as GROUPS
from hybrid.parallel.context import Layout


def members(layout: Layout, kind: str, rank: int) -> list[int]:
    """The ranks of `rank`'s group of `kind`, in group-rank order (empty when it has none)."""
    return next((g for g in layout.groups(kind) if rank in g), [])


def rows(layout: Layout, rank: int, counter: CommCounter) -> dict[str, list[float]]:
    """Bytes `rank` sent to each rank in the step `counter` holds, per group."""
    out = {g: [0.0] * layout.world for g in GROUPS}
    for (g, op), nbytes in counter.bytes.items():
        group = members(layout, g, rank) if g in out else []
        if len(group) > 1:
            for peer, share in _peers(group, group.index(rank), op, nbytes):
                out[g][peer] += share
    return out


def _peers(group: list[int], i: int, op: str, nbytes: int) -> list[tuple[int, float]]:
    n = len(group)
    if op == "send_fwd":
        return [(group[(i + 1) % n], float(nbytes))]
    if op == "send_bwd":
        return [(group[(i - 1) % n], float(nbytes))]
    if op == "all_to_all":
        return [(r, nbytes / n) for j, r in enumerate(group) if j != i]
    return [(group[(i + 1) % n], nbytes * bus_factor(op, n))]


def placed(per_group: dict[str, list[float]], rank: int, world: int) -> list[float]:
    """`rank`'s rows at their place in G world × world blocks, zeros elsewhere (to be summed over ranks)."""
    out = [0.0] * (len(GROUPS) * world * world)
    for k, g in enumerate(GROUPS):
        start = (k * world + rank) * world
        out[start: start + world] = per_group[g]
    return out


def matrices(flat: list[float], world: int) -> dict[str, list[list[float]]]:
    """The summed rows (every rank's `placed` rows, summed over the world) as one matrix per group
    with traffic, plus their `total`."""
    out: dict[str, list[list[float]]] = {}
    for k, g in enumerate(GROUPS):
        block = flat[k * world * world: (k + 1) * world * world]
        if any(block):
            out[g] = [block[r * world: (r + 1) * world] for r in range(world)]
    out["total"] = [[sum(m[r][c] for m in out.values()) for c in range(world)] for r in range(world)]
    return out
