"""Communication timing on gloo ranks: exposed time lands on the rank that waited, DP overlap is measured
(and exactly 0 when the sync runs after the backward), the step breakdown puts a delay inside a phase in that
phase and a delay outside every phase in `other`, the `comm/` bytes are the counter's, the traffic map's rows
are the counter's wire bytes, and profiler traces name collectives by group.

Timed assertions are lower bounds on injected sleeps (load can only lengthen them), or split a late rank's
DELAY_S at its half, far above the scheduling noise of a loaded machine. How much of a real step the
breakdown leaves unattributed is a measurement: `hybrid.bench.timing_overhead` reports it.

Every rank function runs in one world-2 launch (`timing_runs`, once per module), each with its own run folder,
on configs composed before the ranks fork."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from test_dp import synthetic_corpus

from hybrid.compression.hooks import make_hook
from hybrid.config import Config, compose_config
from hybrid.parallel import collectives as C
from hybrid.parallel.context import GROUP_KINDS as GROUPS
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.record import traffic_map
from hybrid.trainer import Trainer, build_chunks

DELAY_S = 0.4  # rank 1's lateness; each side of DELAY_S / 2 leaves 0.2 s for the scheduler's noise
PHASE_DELAY_S = 0.02  # slept in the optimizer step and outside every phase, each training step


def delayed_collectives(rank: int, world: int) -> dict:
    """Rank 1 joins a blocking all-reduce and then an async one DELAY_S late (both ranks leave a barrier first)."""
    group = dist.new_group(list(range(world)))
    C.name_group(group, "tp")
    out = {}
    for kind in ("blocking", "async"):
        dist.barrier(group)
        C.TIMER.begin_step(True)
        t = torch.ones(1024)
        if rank == 1:
            time.sleep(DELAY_S)
        if kind == "blocking":
            C.all_reduce(t, group)
        else:
            work = C.all_reduce(t, group, async_op=True)
            with C.TIMER.waiting("tp"):
                work.wait()
        out[kind] = C.TIMER.end_step().exposed_s["tp"]
    return out


def timed_extra(run_dir: str) -> tuple[str, ...]:
    return (f"logging.dir={run_dir}",)


BREAKDOWN = {(1, 1): "dp2", (2, 1): "tp2", (1, 2): "pp2"}


def jobs(dirs: dict[str, str]) -> dict[str, tuple]:
    """name → (rank function, its arguments after rank and world), each with its own run folder `dirs[name]`."""
    out: dict[str, tuple] = {"delayed": (delayed_collectives, ()),
                             "overlapped": (timed_records, (1, 1, dirs["overlapped"], True)),
                             "serial": (timed_records, (1, 1, dirs["serial"], False)),
                             "profile": (profiled_fit, (dirs["profile"],))}
    for (tp, pp), name in BREAKDOWN.items():
        out[name] = (timed_records, (tp, pp, dirs[name], True, PHASE_DELAY_S))
    return out


def run_jobs(rank: int, world: int, dirs: dict[str, str]) -> dict[str, object]:
    """Rank function: every job in turn → its result by name."""
    return {name: fn(rank, world, *args) for name, (fn, args) in jobs(dirs).items()}


@pytest.fixture(scope="module")
def timing_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name → results by rank of every job, from one world-2 launch; "dirs": name → its run folder."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("timing")
    dirs = {name: str(root / name) for name in ("overlapped", "serial", "profile", *BREAKDOWN.values())}
    for fn, args in jobs(dirs).values():  # composed here once, inherited by the forked ranks
        if fn is timed_records:
            trainer_cfg(*args[:2], timed_extra(args[2]))
        elif fn is profiled_fit:
            trainer_cfg(2, 1, profiled_extra(args[0]))
    results = run_ranks(run_jobs, 2, dirs, timeout=600)
    return {"dirs": dirs, **{name: [r[name] for r in results] for name in jobs(dirs)}}


def test_injected_delay_is_exposed_on_the_waiting_rank_only(timing_runs: dict[str, Any]) -> None:
    waiting, late = timing_runs["delayed"]
    for kind in ("blocking", "async"):
        assert waiting[kind] > 0.5 * DELAY_S, (kind, waiting)
        assert late[kind] < 0.5 * DELAY_S, (kind, late)


def trainer_cfg(tp: int, pp: int, extra: tuple[str, ...] = ()) -> Config:
    return compose_config([
        "model=gpt-tiny", "model.n_layers=4", "model.hidden=128", "model.n_heads=4", "model.max_seq_len=32",
        "data.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=4",
        "train.eval_every=0", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.bucket_mb=0.1",
        "parallel.name=test", *extra])


def make_trainer(tp: int, pp: int, extra: tuple[str, ...] = (), world: int = 2) -> Trainer:
    cfg = trainer_cfg(tp, pp, extra)
    ctx = ParallelContext.build(Layout.create(world, tp=tp, pp=pp))
    corpus = synthetic_corpus()
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, build_chunks(cfg, corpus.vocab_size, ctx), corpus, torch.device("cpu"), hook, state)


def delayed_phases(trainer: Trainer, delay_s: float) -> None:
    """Sleep `delay_s` at the start of each optimizer step (inside the optimizer phase) and in `model.train()`,
    which `train_step` calls between the step's start and its data phase (outside every phase)."""
    step, train = trainer.optimizer.step, trainer.model.train
    trainer.optimizer.step = lambda *a, **k: (time.sleep(delay_s), step(*a, **k))[1]  # type: ignore[method-assign]
    trainer.model.train = lambda *a: (time.sleep(delay_s), train(*a))[1]  # type: ignore[method-assign]


def timed_records(rank: int, world: int, tp: int, pp: int, run_dir: str, in_backward: bool = True,
                  delay_s: float = 0.0) -> dict:
    trainer = make_trainer(tp, pp, timed_extra(run_dir))
    trainer.grad_sync.in_backward = in_backward
    if delay_s:
        delayed_phases(trainer, delay_s)
    records = []
    for _ in range(3):
        C.COUNTER.reset()
        records.append(trainer.step_metrics(trainer.train_step(timed=True)))
    wire = {g: C.COUNTER.wire_bytes(g) for g in GROUPS}
    rows = traffic_map.rows(trainer.ctx.layout, rank, C.COUNTER)
    doc = trainer.report.traffic(trainer.step, lambda line: None)  # collective; rank 0 writes traffic.json
    return {"records": records, "wire": wire, "rows": rows, "doc": doc}


def test_dp_overlap_is_measured_and_zero_after_the_backward(timing_runs: dict[str, Any]) -> None:
    overlapped, serial = timing_runs["overlapped"], timing_runs["serial"]
    assert all(r["comm/overlap_dp"] > 0 for r in overlapped[0]["records"])
    assert all(r["comm/overlap_dp"] == 0.0 for r in serial[0]["records"])


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_breakdown_comm_bytes_and_traffic_map(tp: int, pp: int, timing_runs: dict[str, Any]) -> None:
    name = BREAKDOWN[(tp, pp)]
    results, tmp_path = timing_runs[name], Path(timing_runs["dirs"][name])
    records = results[0]["records"]
    for r in records:  # each rank slept PHASE_DELAY_S in its optimizer phase and as much outside every phase
        assert r["time/optimizer_s"] >= PHASE_DELAY_S and r["time/other_s"] >= PHASE_DELAY_S, r
        parts = [v for k, v in r.items() if k.startswith("time/") and k not in ("time/step_s", "time/other_s")]
        assert sum(parts) + r["time/other_s"] == pytest.approx(r["time/step_s"])
    for r in records:  # comm/ bytes are the counter's bytes (both averaged over the ranks)
        for g in ("tp", "pp", "embedding"):
            counted = sum(v for k, v in r.items() if k.startswith(f"comm/{g}/") and k.endswith("/bytes"))
            assert counted == pytest.approx(r[f"bytes_{g}"], rel=1e-12), g
        assert r["time/compute_s"] > 0 and r["time/bubble_s"] >= 0
    doc = json.loads((tmp_path / "traffic.json").read_text())
    assert doc == results[0]["doc"] == results[1]["doc"]
    for rank, res in enumerate(results):
        for g in GROUPS:  # a rank's row of the map sends exactly its counted wire bytes
            assert sum(res["rows"][g]) == pytest.approx(res["wire"][g], rel=1e-12), (rank, g)
            if g in doc["matrices"]:
                assert doc["matrices"][g][rank] == pytest.approx(res["rows"][g], rel=1e-12)
    if pp == 2:
        assert records[-1]["time/bubble_s"] > 0
        assert all(0 <= r["comm/overlap_pp"] < 1 for r in records)  # sends complete behind compute
        assert doc["matrices"]["pp"][0][1] > 0 and doc["matrices"]["pp"][1][0] > 0  # both directions


def profiled_extra(run_dir: str) -> tuple[str, ...]:
    return (f"logging.dir={run_dir}", "profile.steps=[2,3]", "logging.progress=false", "logging.wandb.mode=disabled")


def profiled_fit(rank: int, world: int, run_dir: str) -> list[str]:
    trainer = make_trainer(2, 1, profiled_extra(run_dir))
    trainer.start()
    trainer.fit()
    trainer.close()
    return sorted(p.name for p in Path(run_dir, "profile").iterdir())


def test_profile_steps_write_traces_naming_groups(timing_runs: dict[str, Any]) -> None:
    files, tmp_path = timing_runs["profile"], Path(timing_runs["dirs"]["profile"])
    assert files[0] == files[1] == ["trace_rank0.json", "trace_rank1.json"]
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("comm:tp:all_reduce") for n in names)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("comm/tp/all_reduce/busbw_gbps" in r for r in records if "loss" in r)
    assert json.loads((tmp_path / "traffic.json").read_text())["matrices"]["tp"][0][1] > 0
    assert (tmp_path / "traffic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
