"""The `sync` config against layouts the two-rank bad-input table cannot make: gossip's one-peer graph on a DP
size that is not a power of two, the hierarchical scope when every DP group lies inside one node; and the group
files' modes."""

from __future__ import annotations

import pytest

from hybrid.config import ConfigError, compose_config
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
