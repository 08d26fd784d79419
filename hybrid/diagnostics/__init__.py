"""Seeing the cluster and its links: the bandwidth bench (`bandwidth`, `preflight`), the cluster report
(`system`, `pairwise`, `advice`) and the heat maps (`heatmap`). The command lines live in `hybrid.tools`."""


class DiagnosticsError(ValueError):
    """Bad input to a diagnostics tool (unknown op, sizes out of order, a layout that does not fit)."""
