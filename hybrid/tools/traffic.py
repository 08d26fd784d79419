"""Draw a run's traffic map: bytes per step, rank → rank (the run writes `traffic.json` on its last step).

    python -m hybrid.tools.traffic runs/<run>/traffic.json --png map.png [--group dp]

Prints the matrix of `--group` (default `total`: every group summed) in MB per step with each rank's
row and column totals, and writes it as a heat map with `--png`. Bad input (no such
file, not a traffic map, an unknown group) is one `hybrid: error: ...` line and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from hybrid.cli import EXIT_BAD_INPUT, UsageError, run_tool
from hybrid.diagnostics.heatmap import write_heatmap


def parse_args(argv: list[str]) -> tuple[str, Optional[str], str]:
    """(traffic.json path, PNG path or None, group)."""
    words, png, group = list(argv), None, "total"
    for flag in ("--png", "--group"):
        if flag in words:
            i = words.index(flag)
            if i + 1 >= len(words):
                raise UsageError(f"{flag} needs a value")
            value = words.pop(i + 1)
            words.pop(i)
            png, group = (value, group) if flag == "--png" else (png, value)
    if len(words) != 1 or words[0].startswith("-"):
        raise UsageError(f"expected one traffic.json path and optional --png PATH --group NAME, got {argv}")
    return words[0], png, group


def load(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or "matrices" not in doc:
        raise UsageError(f"{path} is not a traffic map (no 'matrices'): written by a run as <logging.dir>/traffic.json")
    return doc


def render(matrix: list[list[float]], group: str, step: Any) -> str:
    """The matrix in MB with row (sent) and column (received) totals."""
    n = len(matrix)
    lines = [f"traffic map, group {group}, step {step}: MB sent per step, row rank → column rank"]
    lines.append("       " + "".join(f"{f'r{c}':>9}" for c in range(n)) + f"{'sent':>10}")
    for r, row in enumerate(matrix):
        lines.append(f"{f'r{r}':>6} " + "".join(f"{x / 1e6:9.3f}" for x in row) + f"{sum(row) / 1e6:10.3f}")
    lines.append(f"{'recv':>6} " + "".join(f"{sum(matrix[r][c] for r in range(n)) / 1e6:9.3f}" for c in range(n)))
    return "\n".join(lines)


def body(argv: list[str]) -> str:
    path, png, group = parse_args(argv)
    doc = load(path)
    if group not in doc["matrices"]:
        raise UsageError(f"group {group!r} has no traffic in {path}; it has {', '.join(doc['matrices'])}")
    matrix = doc["matrices"][group]
    out = render(matrix, group, doc.get("step"))
    if png:
        write_heatmap(matrix, png, f"bytes sent per step ({group}), rank → rank", "bytes", doc.get("node_of"),
                      row_label="sender rank", col_label="receiver rank")
        out += f"\nwrote {png}"
    return out


def main(argv: Optional[list[str]] = None) -> int:
    return run_tool(__doc__, argv, body, ((UsageError, EXIT_BAD_INPUT),))


if __name__ == "__main__":
    sys.exit(main())
