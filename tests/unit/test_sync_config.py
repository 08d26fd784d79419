"""The `sync` config against layouts the two-rank bad-input table cannot make: gossip's one-peer graph on a DP
size that is not a power of two, the hierarchical scope when every DP group lies inside one node; and the group
files' modes."""

from __future__ import annotations

import pytest

from hybrid.config import ConfigError, compose_config
from hybrid.sync import startup_lines
from hybrid.sync.gossip import neighbours
from hybrid.validation import validate


def test_one_peer_gossip_needs_a_power_of_two_replicas() -> None:
    validate(compose_config(["sync=gossip", "sync.topology=one_peer"]), 4)
    with pytest.raises(ConfigError, match="needs a DP size that is a power of two, got dp=3"):
        validate(compose_config(["sync=gossip", "sync.topology=one_peer", "train.global_batch_size=24"]), 3)


def test_hierarchical_scope_needs_dp_across_nodes() -> None:
    validate(compose_config(["sync=diloco", "sync.scope=inter", "parallel.ranks_per_node=2"]), 4)
    with pytest.raises(ConfigError, match="every DP group here lies inside one node"):
        validate(compose_config(["sync=diloco", "sync.scope=inter", "parallel=pp2", "parallel.ranks_per_node=2"]), 4)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_every_graph_is_symmetric_and_regular(n: int) -> None:
    """Uniform weights mix doubly stochastically only on a symmetric, regular graph (one_peer: a matching)."""
    for topology in ("ring", "exponential", "complete", "one_peer"):
        if topology == "one_peer" and n & (n - 1):
            continue
        for round_ in range(3):
            graph = {i: neighbours(topology, n, i, round_) for i in range(n)}
            assert all(i in graph[j] for i in graph for j in graph[i]), (topology, n)
            assert len({len(v) for v in graph.values()}) == 1, (topology, n)


def test_group_files_name_their_modes() -> None:
    assert compose_config(["sync=local_sgd"]).sync.mode == "diloco"
    cfg = compose_config(["sync=local_sgd"]).sync
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.nesterov) == (1.0, 0.0, False)  # plain averaging
    assert compose_config(["sync=gossip"]).sync.mode == "gossip"
    assert compose_config([]).sync.mode == "dp"


@pytest.mark.parametrize("group", ["gossip", "ps"])
def test_a_mode_with_nothing_to_exchange_says_so_at_start_up(group: str) -> None:
    """At dp=1 a replica-level mode trains one replica: one note line instead of running silently."""
    one, two = (compose_config([f"sync={group}"]) for _ in range(2))
    note = f"note: sync.mode={group} has nothing to exchange at dp=1: the run trains one replica"
    assert startup_lines(one, validate(one, 1)) == [note]
    assert startup_lines(two, validate(two, 2)) == []


def test_the_exchange_line_names_the_hook_and_its_split_over_nodes() -> None:
    """The start-up line of a compressed exchange (sync=dp and sync=diloco alike); none when it is exact."""
    plain = compose_config([])
    assert startup_lines(plain, validate(plain, 2)) == []
    cfg = compose_config(["compression=hierarchical-powersgd", "parallel.ranks_per_node=2"])
    (line,) = startup_lines(cfg, validate(cfg, 4))
    assert line.startswith("compression: hierarchical over dp=4")
    assert "exact inside a node (2 DP ranks), powersgd" in line
    diloco = compose_config(["sync=diloco", "compression=int8"])
    assert startup_lines(diloco, validate(diloco, 2))[1:] == ["compression: int8 over dp=2"]  # after the outer step's
