"""ParallelContext's rank map as pure functions, against a numpy reshape of the rank grid.

Reference: ranks laid out as `arange(world).reshape(pp, dp, tp)` (TP innermost, PP outermost);
each group kind is a slice of that array along one axis.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.parallel.context import Layout, LayoutError

LAYOUTS = [  # (world, tp, pp, ranks_per_node)
    (1, 1, 1, 1), (2, 1, 1, 2), (8, 2, 4, 8), (8, 2, 4, 2), (8, 2, 2, 4), (8, 1, 4, 2), (8, 4, 2, 4),
    (16, 2, 2, 4), (16, 4, 1, 8), (12, 2, 3, 4),
]


def slices(grid: np.ndarray, axis: int) -> list[list[int]]:
    moved = np.moveaxis(grid, axis, -1)
    return sorted(sorted(row.tolist()) for row in moved.reshape(-1, moved.shape[-1]))


@pytest.mark.parametrize("world,tp,pp,rpn", LAYOUTS)
def test_groups_are_slices_of_the_rank_grid(world: int, tp: int, pp: int, rpn: int) -> None:
    layout = Layout.create(world, tp=tp, pp=pp, ranks_per_node=rpn)
    grid = np.arange(world).reshape(pp, layout.dp, tp)
    assert sorted(map(sorted, layout.tp_groups())) == slices(grid, 2)
    assert sorted(map(sorted, layout.dp_groups())) == slices(grid, 1)
    assert sorted(map(sorted, layout.pp_groups())) == slices(grid, 0)
    for r in range(world):
        c = layout.coord(r)
        assert grid[c.pp, c.dp, c.tp] == r and layout.rank(c.pp, c.dp, c.tp) == r
    for g in layout.tp_groups():  # TP stays inside one node
        assert len({layout.node(r) for r in g}) == 1
    firsts_lasts = sorted(sorted({int(a), int(b)}) for a, b in zip(grid[0].ravel(), grid[-1].ravel()))
    assert sorted(layout.embedding_groups()) == firsts_lasts


@pytest.mark.parametrize("world,tp,pp,rpn", LAYOUTS)
def test_hierarchical_dp_groups_split_dp_by_node(world: int, tp: int, pp: int, rpn: int) -> None:
    layout = Layout.create(world, tp=tp, pp=pp, ranks_per_node=rpn)
    intra, inter = layout.dp_intra_node_groups(), layout.dp_inter_node_groups()
    for g in intra:
        assert len({layout.node(r) for r in g}) == 1
    for g in inter:
        assert len({layout.node(r) for r in g}) == len(g)  # one rank per node
    for dp_group in layout.dp_groups():  # intra × inter tile each DP group exactly
        members = set(dp_group)
        mine_intra = [g for g in intra if set(g) <= members]
        mine_inter = [g for g in inter if set(g) <= members]
        assert sorted(r for g in mine_intra for r in g) == sorted(dp_group)
        assert sorted(r for g in mine_inter for r in g) == sorted(dp_group)


def test_rank_map_lists_every_rank_once() -> None:
    layout = Layout.create(8, tp=2, pp=2, ranks_per_node=4)
    text = layout.rank_map()
    assert text.count("node ") == 2
    for r in range(8):
        c = layout.coord(r)
        assert f"r{r}=(pp{c.pp},dp{c.dp},tp{c.tp})" in text


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world=8, tp=3), "does not divide world size 8"),
    (dict(world=8, tp=2, pp=2, dp=4), "parallel.dp=4"),
    (dict(world=8, tp=4, ranks_per_node=2), "span nodes"),
    (dict(world=8, tp=2, ranks_per_node=3), "ranks_per_node=3"),
    (dict(world=8, tp=0), "must be >= 1"),
])
def test_bad_layouts_are_rejected(kwargs: dict, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        Layout.create(**kwargs)


def test_tp_across_nodes_allowed_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="span nodes"):
        layout = Layout.create(8, tp=4, ranks_per_node=2, allow_tp_across_nodes=True)
    assert layout.tp == 4
