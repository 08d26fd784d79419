"""Which parameters PowerSGD may send as rows (`hybrid.sync.dp.lookup_tables`, `compression/rows.py`): an untied
token embedding, never one tied to the head (its gradient is dense), nor a learned position table;
and `Compression.set_lookups` names them to the state that sends them (PowerSGD's, a hierarchical method's inner).
The exchange itself is tested on gloo ranks in tests/dist/test_lookup_rows.py."""

from __future__ import annotations

import pytest
import torch

from hybrid.compression.hooks import make_hook
from hybrid.compression.rows import fits, touched
from hybrid.config import CompressionConfig, compose_config
from hybrid.parallel.context import ParallelContext
from hybrid.sync.dp import lookup_tables
from hybrid.trainer import build_chunks


@pytest.mark.parametrize("model,names", [("llama-tiny", {"tok_embed.weight"}), ("gpt-tiny", set()),
                                         ("gpt-tiny model.tie_embeddings=false", {"tok_embed.weight"})])
def test_lookup_tables_are_the_untied_embeddings(model: str, names: set[str]) -> None:
    name, *extra = model.split()
    cfg = compose_config([f"model={name}", "model.n_layers=1", *extra])
    chunks = build_chunks(cfg, 512, ParallelContext.single())
    ids = lookup_tables(cfg, chunks)
    assert {n for n, p in chunks[0].named_parameters() if id(p) in ids} == names


def test_set_lookups_reaches_the_state_that_sends_rows() -> None:
    group = None  # one rank: no process group needed to build the states
    for cfg in (CompressionConfig(method="powersgd"), CompressionConfig(method="hierarchical", inner="powersgd")):
        _, state = make_hook(cfg, group, group, group)
        state.set_lookups(frozenset({7}))
        inner = getattr(state.state, "inner_state", state.state)
        assert inner.lookups == frozenset({7})
    _, state = make_hook(CompressionConfig(method="sign"), group)
    state.set_lookups(frozenset({7}))  # a method without rows: nothing to name
    assert not hasattr(state.state, "lookups")


def test_touched_rows_and_what_fits() -> None:
    g = torch.zeros(6, 4)
    g[1, 2], g[4] = 1.0, -2.0
    assert touched(g).tolist() == [0, 1, 0, 0, 1, 0]
    assert fits(2, (6, 4), 2 * 4 + 6 / 4) and not fits(3, (6, 4), 2 * 4 + 6 / 4)
