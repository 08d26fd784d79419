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


@pytest.mark.parametrize("world,tp,pp,rpn", LAYOUTS)
def test_hybrid_sharding_groups_are_the_node_split_at_zero_group_node(world: int, tp: int, pp: int, rpn: int) -> None:
    """`parallel.zero_group=node`: the shard and replica groups are the node-cut DP groups; a number of ranks cuts
    each DP group into consecutive parts and the ranks at one place of each; dp is all of them."""
    layout = Layout.create(world, tp=tp, pp=pp, ranks_per_node=rpn)
    shard, replica = layout.zero_groups(layout.zero_shard_size("node"))
    if all(len(g) == len(shard[0]) for g in layout.dp_intra_node_groups()):
        assert sorted(shard) == sorted(layout.dp_intra_node_groups())
        assert sorted(replica) == sorted(layout.dp_inter_node_groups())
    assert layout.zero_shard_size("dp") == layout.dp
    for size in (s for s in range(1, layout.dp + 1) if layout.dp % s == 0):
        shard, replica = layout.zero_groups(size)
        assert all(len(g) == size for g in shard) and all(len(g) == layout.dp // size for g in replica)
        for dp_group in layout.dp_groups():
            assert [r for g in shard if g[0] in dp_group for r in g] == dp_group


@pytest.mark.parametrize("spec", ["3", "0", "many"])
def test_a_zero_group_that_does_not_divide_dp_is_refused(spec: str) -> None:
    with pytest.raises(LayoutError, match=f"parallel.zero_group={spec} must be dp, node or a number"):
        Layout.create(8, tp=2).zero_shard_size(spec)


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
    (dict(world=8, tp=2, cp=2, ranks_per_node=2), "CP group of 2 ranks would span nodes of 2 ranks.*allow_cp"),
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


def test_cp_inside_nodes_passes_and_across_nodes_is_allowed_with_a_warning() -> None:
    assert Layout.create(8, tp=2, cp=2, ranks_per_node=4).groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.warns(UserWarning, match="CP's every-layer K/V exchange"):
        layout = Layout.create(8, cp=4, ranks_per_node=2, allow_cp_across_nodes=True)
    assert layout.cp == 4


# ---- named axes: sizes, an order, groups over any axes ---------------------------------------

ORDERS = ["tp-cp-dp-pp", "tp-dp-cp-pp", "cp-tp-dp-pp", "tp-cp-pp-dp"]


def test_three_axis_rank_order_and_groups_are_unchanged_at_cp1() -> None:
    """The formula and the loops the mesh had before its axes were named: the same ranks, groups and order."""
    layout = Layout.create(16, tp=2, pp=2, ranks_per_node=4)
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    for r in range(16):
        c = layout.coord(r)
        assert r == (c.pp * dp + c.dp) * tp + c.tp and c.cp == 0 and dict(c) == {"tp": c.tp, "cp": 0, "dp": c.dp,
                                                                                 "pp": c.pp}
    rank = layout.rank
    assert layout.tp_groups() == [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
    assert layout.dp_groups() == [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    assert layout.pp_groups() == [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    assert layout.cp_groups() == [[r] for r in range(16)] and layout.coord(5).key("rng") == "rng.pp0.dp2.tp1"
    assert layout.describe() == "pp2 × dp4 × tp2"


@pytest.mark.parametrize("order", ORDERS)
def test_groups_over_named_axes_are_slices_of_the_grid_in_any_order(order: str) -> None:
    layout = Layout.create(24, tp=2, cp=3, pp=2, ranks_per_node=24, order=order)
    axes = order.split("-")
    grid = np.arange(24).reshape([layout.size(a) for a in reversed(axes)])  # outermost first
    position = {a: len(axes) - 1 - i for i, a in enumerate(axes)}
    for axis in axes:
        assert sorted(layout.groups(axis)) == slices(grid, position[axis])
    for r in range(24):
        c = layout.coord(r)
        assert grid[tuple(c[a] for a in reversed(axes))] == r and layout.rank(**c) == r
    plane = np.moveaxis(grid, [position["cp"], position["dp"]], [-2, -1]).reshape(-1, 3 * layout.dp)
    assert sorted(layout.groups("dp-cp")) == sorted(sorted(row.tolist()) for row in plane)


def test_group_names_follow_the_order_and_keys_name_cp_only_where_it_counts() -> None:
    layout = Layout.create(8, tp=2, cp=2, ranks_per_node=8)
    assert layout.group_name("dp-cp") == layout.group_name(("cp", "dp")) == "cp-dp"
    assert Layout.create(8, tp=2, cp=2, order="tp-dp-cp-pp").group_name("cp-dp") == "dp-cp"
    assert layout.coord(2).key("sync") == "sync.pp0.dp0.cp1.tp0" and layout.coord(4).key("sync") == "sync.pp0.dp1.tp0"
    assert layout.describe() == "pp1 × dp2 × cp2 × tp2" and "r3=(pp0,dp0,cp1,tp1)" in layout.rank_map()
    with pytest.raises(LayoutError, match="unknown mesh axes"):
        layout.groups("ep")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world=8, tp=2, cp=0), "parallel.cp must be >= 1"),
    (dict(world=8, tp=2, cp=3), "parallel.tp·parallel.cp·parallel.pp = 2·3·1 = 6 does not divide world size 8"),
    (dict(world=8, tp=2, order="tp-dp-pp"), "must name each of"),
    (dict(world=8, tp=2, dp=4, ranks_per_node=4, order="dp-tp-cp-pp"), "span nodes"),  # TP strided by dp
])
def test_bad_named_layouts_are_rejected(kwargs: dict, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle.replace("(", r"\(")):
        Layout.create(**kwargs)
