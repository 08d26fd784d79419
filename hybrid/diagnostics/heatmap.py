"""A rank × rank matrix as a PNG heat map: measured bandwidth between ranks, bytes each rank sends to
each other rank, anything indexed by two ranks. Cells carry their values when the matrix is small
enough to read them; NaN cells (the diagonal of a bandwidth matrix) stay blank; with `node_of`,
lines mark where one node's ranks end and the next one's begin.

matplotlib (a core dependency) is imported inside `write_heatmap`, not at module level, so importing this
module (the trainer does, through `hybrid.record.report`) costs no start-up time; it draws on the Agg canvas (no
display, no pyplot state).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from matplotlib.axes import Axes

ANNOTATE_MAX = 16  # annotate every cell up to this many ranks


def node_boundaries(node_of: list[int]) -> list[int]:
    """The indices k where rank k is on another node than rank k − 1."""
    return [k for k in range(1, len(node_of)) if node_of[k] != node_of[k - 1]]


def write_heatmap(matrix: list[list[float]], path: str, title: str, unit: str, node_of: Optional[list[int]] = None,
                  row_label: str = "rank", col_label: str = "rank") -> None:
    """Write `matrix` (rows × columns, NaN = no value) as a PNG at `path`, coloured by value from 0 (or
    the least value, if negative), with a colour bar in `unit`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(matrix), max((len(r) for r in matrix), default=0)
    side = min(16.0, max(4.0, 0.6 * max(rows, cols) + 2.0))
    fig = Figure(figsize=(side + 1.2, side))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    cells = [[math.nan if v is None else v for v in row] for row in matrix]
    low = min([0.0, *(v for row in cells for v in row if math.isfinite(v))])  # from 0: sizes read as sizes
    image = ax.imshow(cells, cmap="viridis", vmin=low, interpolation="nearest")
    fig.colorbar(image, ax=ax, label=unit)
    if max(rows, cols) <= ANNOTATE_MAX:
        _annotate(ax, cells, low)
    for k in node_boundaries(node_of or []):
        ax.axhline(k - 0.5, color="red", linewidth=2)
        ax.axvline(k - 0.5, color="red", linewidth=2)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    ax.set_title(title + ("  (red lines: node boundaries)" if node_of and node_boundaries(node_of) else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")


def _annotate(ax: Axes, cells: list[list[float]], low: float) -> None:
    """Each finite cell's value (3 significant digits), dark on the bright half of the colour scale."""
    values = [v for row in cells for v in row if math.isfinite(v)]
    mid = (low + max(values, default=low)) / 2
    for i, row in enumerate(cells):
        for j, v in enumerate(row):
            if math.isfinite(v):
                ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8, color="black" if v > mid else "white")
