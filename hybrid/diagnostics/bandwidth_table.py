"""nccl-tests' text table of a `bandwidth.Table`: size, count, type, redop, root, then time, algbw, busbw
and #wrong out of place and in place, the average bus bandwidth and the spread of the per-rank times."""

from __future__ import annotations

from typing import Optional

from hybrid.diagnostics.bandwidth import REDUCING, ROOT, Cell, Table

HEADER = ("#{:>11} {:>12} {:>9} {:>6} {:>5}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} {:>7} {:>6}")


def _cell_text(c: Optional[Cell]) -> str:
    if c is None:
        return f"{'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    us = c.time_avg * 1e6
    wrong = "N/A" if c.wrong is None else str(c.wrong)
    return f"{us:>9.{2 if us < 1e4 else 0}f} {c.algbw:>7.2f} {c.busbw:>7.2f} {wrong:>6}"


def render(t: Table) -> str:
    """nccl-tests' table: size, count, type, redop, root, then time (µs, mean over ranks), algbw, busbw
    (GB/s, from the slowest rank) and #wrong out of place and in place; then the average bus bandwidth
    and the spread of the per-rank times at the largest size."""
    redop, root = ("sum" if t.op in REDUCING else "none"), (ROOT if t.op == "broadcast" else -1)
    g = t.groups
    lines = [f"# {t.op} over {g.kind}: {len(g.ranks)} group(s) of {g.size} ranks at once, {t.dtype}",
             f"#{'':49}{'out-of-place':^32}  {'in-place':^32}".rstrip(),
             HEADER.format("size", "count", "type", "redop", "root", *["time", "algbw", "busbw", "#wrong"] * 2),
             HEADER.format("(B)", "(elements)", "", "", "", *["(us)", "(GB/s)", "(GB/s)", ""] * 2).rstrip()]
    for r in t.rows:
        lines.append(f"{r.size:>12} {r.count:>12} {t.dtype:>9} {redop:>6} {root:>5}  "
                     f"{_cell_text(r.out_of_place)}  {_cell_text(r.in_place)}")
    last = t.rows[-1].out_of_place
    lines += [f"# Avg bus bandwidth    : {t.avg_busbw:.4g} GB/s",
              f"# per-rank time at {t.rows[-1].size} B (out-of-place): min {last.time_min * 1e6:.2f} us "
              f"(rank {last.rank_min}), avg {last.time_avg * 1e6:.2f} us, max {last.time_max * 1e6:.2f} us "
              f"(rank {last.rank_max}); bandwidths use the max"]
    return "\n".join(lines)
