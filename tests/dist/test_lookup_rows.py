"""PowerSGD's lookup rows (`compression/rows.py`) on gloo ranks, against the exact fp32 mean (`dist.all_reduce`).

One bucket holds a lookup table (64 × 16, named in `lookups`), a dense matrix PowerSGD factors (32 × 24) and a
bias; each rank's gradient touches a few of the table's rows (from a seed, so the test rebuilds every rank's). Four
steps at dp=2 and dp=4 (one world-4 launch, a pair group beside the whole):
  1. few rows, no residual yet: the table is the exact DP mean (zeros outside the union) and the bytes are the
     mask (n bytes, its own all-reduce) plus 4·(bias + |U|·m + the dense matrix's factors and probe);
  2. every row touched: more than the factors cost, so the table goes as factors (no longer exact);
  3. few rows again: on the union the exact mean of gradient + residual, the residual there zero and elsewhere
     the residual step 2 left;
  4. `compression.lookup_rows=false`: factors, and no mask exchange.
Every rank's output is the same, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from hybrid.compression.hooks import make_hook
from hybrid.compression.rows import MASK_ELEMENTS
from hybrid.config import CompressionConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.dp.buckets import GradBucket

TABLE, DENSE, BIAS = (64, 16), (32, 24), (24,)
SHAPES = [TABLE, DENSE, BIAS]
RANK = 4
FEW = 3  # rows each rank touches on a sparse step: the union (≤ 12) costs less than the table's factors (320)
WORLD = 4
TIMEOUT = 120


def numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def grads(rank: int, step: int, rows: int) -> torch.Tensor:
    """Rank `rank`'s flat gradient at `step`: `rows` rows of the table (TABLE[0]: all of them), the rest dense."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    table = torch.zeros(TABLE)
    picked = torch.randperm(TABLE[0], generator=gen)[:rows]
    table[picked] = torch.randn(rows, TABLE[1], generator=gen)
    rest = torch.randn(numel(DENSE) + numel(BIAS), generator=gen)
    return torch.cat([table.reshape(-1), rest])


def bucket(params: list[nn.Parameter], flat: torch.Tensor) -> GradBucket:
    return GradBucket(0, flat.clone(), params, True)


def mean(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The reference: fp32 sum by `dist.all_reduce` (uncounted), divided by the group size."""
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def run_steps(rank: int, group: dist.ProcessGroup, name: str, lookup_rows: bool) -> list[dict]:
    """The four steps' figures on this rank of `group` (see the module doc)."""
    params = [nn.Parameter(torch.empty(s)) for s in SHAPES]
    hook, state = make_hook(CompressionConfig(method="powersgd", rank=RANK, warmup_steps=0, factor_dtype="fp32",
                                              lookup_rows=lookup_rows), group)
    state.set_lookups(frozenset({id(params[0])}))
    inner, out = state.state, []
    for step, rows in enumerate((FEW, TABLE[0], FEW)):
        g = grads(dist.get_rank(), step, rows)
        before = inner.residual.get(0, torch.zeros_like(g)).clone()
        C.COUNTER.reset()
        b = bucket(params, g)
        value = hook(state, b).wait()
        value = value[0] if isinstance(value, list) else value
        out.append({"value": value.clone(), "exact": mean(g + before, group), "union": mean((g != 0).float(), group),
                    "bytes": C.COUNTER.group_bytes(name), "calls": dict(C.COUNTER.calls),
                    "residual": inner.residual[0].clone(), "before": before})
    return out


def worker(rank: int, world: int) -> dict[str, list[dict]]:
    out = {}
    for size in (2, world):
        group = dist.new_group(list(range(size)))
        C.name_group(group, f"dp{size}")
        for lookup_rows in (True, False):
            if rank < size:
                out[f"dp{size}-{lookup_rows}"] = run_steps(rank, group, f"dp{size}", lookup_rows)
    return out


@functools.cache
def launched() -> list[dict[str, list[dict]]]:
    torch.set_num_threads(1)
    return run_ranks(worker, WORLD, timeout=TIMEOUT)


def table(t: torch.Tensor) -> torch.Tensor:
    return t[: numel(TABLE)].view(TABLE)


def union_rows(step: dict) -> torch.Tensor:
    """The rows any rank's gradient touched (from the exact mean of the nonzero masks)."""
    return table(step["union"]).ne(0).any(1)


def factor_elements(shape: tuple[int, int]) -> int:
    """A matrix's factors at RANK and its error probe (the adaptive rank, on by default)."""
    return (shape[0] + shape[1]) * RANK + min(shape)


@pytest.mark.parametrize("size", [2, WORLD], ids=["dp2", "dp4"])
def test_few_rows_go_exactly_and_cost_the_rows(size: int) -> None:
    results = [r[f"dp{size}-True"] for r in launched()[:size]]
    first = results[0][0]
    u = union_rows(first)
    assert 0 < int(u.sum()) <= size * FEW
    torch.testing.assert_close(table(first["value"]), table(first["exact"]), rtol=0, atol=1e-7)
    assert table(first["value"])[~u].abs().sum() == 0
    rows = int(u.sum()) * TABLE[1]
    assert first["bytes"] == TABLE[0] + 4 * (numel(BIAS) + rows + factor_elements(DENSE))  # mask (uint8) + floats
    assert rows + MASK_ELEMENTS * TABLE[0] <= factor_elements(TABLE)
    for r in results[1:]:
        assert all(torch.equal(a["value"], b["value"]) for a, b in zip(r, results[0]))  # replicas alike


@pytest.mark.parametrize("size", [2, WORLD], ids=["dp2", "dp4"])
def test_every_row_touched_goes_as_factors(size: int) -> None:
    second = launched()[0][f"dp{size}-True"][1]
    assert bool(union_rows(second).all())
    assert second["bytes"] == TABLE[0] + 4 * (numel(BIAS) + factor_elements(TABLE) + factor_elements(DENSE))
    assert (table(second["value"]) - table(second["exact"])).abs().max() > 1e-3  # rank 4 of a random 64 × 16
    assert table(second["residual"]).abs().sum() > 0


@pytest.mark.parametrize("size", [2, WORLD], ids=["dp2", "dp4"])
def test_rows_carry_their_residual_and_the_rest_keep_theirs(size: int) -> None:
    for r in launched()[:size]:
        third = r[f"dp{size}-True"][2]
        u = union_rows(third)
        torch.testing.assert_close(table(third["value"])[u], table(third["exact"])[u], rtol=0, atol=1e-6)
        assert table(third["value"])[~u].abs().sum() == 0
        assert table(third["residual"])[u].abs().sum() == 0
        assert torch.equal(table(third["residual"])[~u], table(third["before"])[~u])  # kept for a later step


@pytest.mark.parametrize("size", [2, WORLD], ids=["dp2", "dp4"])
def test_off_the_table_goes_as_factors_without_a_mask(size: int) -> None:
    first = launched()[0][f"dp{size}-False"][0]
    assert first["bytes"] == 4 * (numel(BIAS) + factor_elements(TABLE) + factor_elements(DENSE))
    assert (table(first["value"]) - table(first["exact"])).abs().max() > 0
