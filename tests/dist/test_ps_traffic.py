"""The parameter server's exchanges in a step's record, against the formula, on 3 gloo ranks: `bytes_dp` and
`comm/ps/{send,recv}/bytes` count every push and reply (and the last step's stops), and a slow server's wait is
`time/comm_ps_s`, not `time/optimizer_s` (a delay injected into the server, 0.5 s a version — far beyond the
optimizer's own milliseconds here)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pp_helpers import VOCAB, Case, make_cfg
from test_dp import synthetic_corpus
from tp_helpers import run_frozen

from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.sync.server import Server
from hybrid.trainer import Trainer, build_chunks

WORLD, STEPS, DELAY = 3, 3, 0.5
MODES = {"ps": ("sync=ps",), "ps-2-servers": ("sync=ps", "sync.servers=2"),
         "ps-async-3-servers": ("sync=ps_async", "sync.max_staleness=1", "sync.servers=3")}
SERVERS = {"ps": 1, "ps-2-servers": 2, "ps-async-3-servers": 3}
SLOW = "ps"  # the mode trained again with the injected delay


def cfg_of(mode: str) -> Any:
    return make_cfg(Case(extra=("model.n_layers=1",)), WORLD,
                    extra=[*MODES[mode], f"train.steps={STEPS}", "train.global_batch_size=6"])


def slowed(apply: Any) -> Any:
    def slow(self: Server, pushes: Any) -> None:
        time.sleep(DELAY)
        apply(self, pushes)

    return slow


def records(rank: int, world: int) -> dict[str, Any]:
    """Rank function: every mode's timed step records (`Trainer.step_metrics`), then the slow server's; and the
    trained elements of the replica."""
    ctx = ParallelContext.build(Layout.create(world))
    out: dict[str, Any] = {}
    for name in [*MODES, "slow"]:
        if name == "slow":
            Server._apply = slowed(Server._apply)  # type: ignore[method-assign] - this rank process only
        cfg = cfg_of(SLOW if name == "slow" else name)
        trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"))
        out[name] = [step_record(trainer) for _ in range(STEPS)]
        out["numel"] = sum(p.numel() for p in trainer.model.parameters())
    return out


def step_record(trainer: Trainer) -> dict[str, Any]:
    """One logged step's record, its bytes counted from zero (as `Trainer.fit` does on every step)."""
    C.COUNTER.reset()
    return trainer.step_metrics(trainer.train_step(timed=True))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    for mode in MODES:
        cfg_of(mode)
    return run_frozen(records, WORLD, timeout=300)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_push_and_reply_is_in_the_records_bytes(ranks: list[dict[str, Any]], mode: str) -> None:
    """A worker pushes [4 header floats + its shard's gradient] to each of the S servers not on its rank and gets
    [1 + the shard's parameters] back: over W workers, (W − 1)(5S + 2N) floats a step (N the replica's elements),
    and at the last step each worker's stop to each remote server, (W − 1)(4S + N) more. Means per rank."""
    n, s = ranks[0]["numel"], SERVERS[mode]
    step = 4 * (WORLD - 1) * (5 * s + 2 * n) / WORLD
    stop = 4 * (WORLD - 1) * (4 * s + n) / WORLD
    got = [r["bytes_dp"] for r in ranks[0][mode]]
    assert got == pytest.approx([step] * (STEPS - 1) + [step + stop])
    last = ranks[0][mode][-1]
    assert last["comm/ps/send/bytes"] + last["comm/ps/recv/bytes"] == pytest.approx(step + stop)
    assert all([x["bytes_dp"] for x in r[mode]] == got for r in ranks[1:])  # the same record on every rank


def test_a_slow_servers_wait_is_ps_time_not_optimizer_time(ranks: list[dict[str, Any]]) -> None:
    for record in ranks[0]["slow"]:
        assert record["time/comm_ps_s"] >= 0.8 * DELAY
        assert record["time/optimizer_s"] < 0.5 * DELAY
        assert record["comm/ps/exposed_s"] == pytest.approx(record["time/comm_ps_s"])
