"""`compression.schedule=auto` through `Trainer.fit` on gloo ranks (tp2dp2), against references.

One world-4 launch trains the same tiny model (1 layer, 8 steps) several times, each through the real loop
(metrics.jsonl with a record per step; no traffic map: matplotlib is not what is tested), every config composed
before the ranks fork:

- exact (`compression=none`): the reference losses. The settling tolerance is then chosen from them, so
  that the rule, applied to them by a reference written here, first holds as late in the run as it can;
- auto (sign): until its switch, bit for bit the exact run; the switch at the reference's step, on every
  rank alike, announced in one line; each record names the step's method, and counts the bytes the
  library's formulas give (the vectors kept exact all along, the rest exact, then sign-coded);
- fixed (sign, `warmup_steps` = the auto run's switch, vectors kept exact): the same run, bit for bit;
- auto resumed from step 3 (mid-window): the same switch and losses; resumed after the switch under
  tp1dp4: the decision kept (no second exact stage);
- onebit_adam under auto against onebit_adam with `warmup_steps` at its switch: the same run, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from harness import run_ranks
from omegaconf import OmegaConf
from pp_helpers import VOCAB, Case, layout_context, make_cfg
from test_compression_train import expected_step
from test_dp import synthetic_corpus

from hybrid.checkpoint import plan_resume, step_path
from hybrid.compression.hooks import make_hook
from hybrid.parallel.context import ParallelContext
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

STEPS, WINDOW, EVERY = 8, 2, 3
TIMEOUT = 300
SIGN = ["compression=sign", "compression.block_size=64"]


def reference_switch(losses: list[float], window: int, tol: float) -> Optional[int]:
    """The documented rule on a loss curve: the first step t with ≥ 2·window losses whose last window's mean
    fell less than `tol` (relative) below the window before."""
    for t in range(2 * window, len(losses) + 1):
        before, last = np.mean(losses[t - 2 * window:t - window]), np.mean(losses[t - window:t])
        if (before - last) / abs(before) < tol:
            return t
    return None


def tolerance_for(losses: list[float]) -> float:
    """A tolerance the reference rule first meets as late as it can (before the last 3 steps): at the latest
    step whose drop is below every earlier one, halfway between that drop and the smallest earlier one."""
    drops = {t: (np.mean(losses[t - 2 * WINDOW:t - WINDOW]) - np.mean(losses[t - WINDOW:t]))
             / np.mean(losses[t - 2 * WINDOW:t - WINDOW]) for t in range(2 * WINDOW, STEPS - 2)}
    for t in sorted(drops, reverse=True):
        earlier = [d for s, d in drops.items() if s < t]
        if not earlier or drops[t] < min(earlier):
            return float((drops[t] + min(earlier)) / 2) if earlier else float(drops[t] + 1e-6)
    raise AssertionError("unreachable: the first step always qualifies")


def fit_cfg(case: Case, world: int, root: Path, run: str, extra: list[str], every: int = 0) -> Any:
    """The config of run `run`: a 1-layer model, a record per step, a checkpoint every `every` steps (buckets of
    0.05 MB: the exact run's and the auto run's warm-up, whose buckets differ, sum alike there)."""
    return make_cfg(case, world, bucket_mb=0.05, extra=[f"train.steps={STEPS}", "train.lr=1e-2", "model.n_layers=1",
                                        f"logging.dir={root / run}", "logging.log_every=1", "logging.progress=false",
                                        "logging.wandb.mode=disabled", "logging.traffic_map=false",
                                        f"checkpoint.dir={root}", f"run_name={run}", f"checkpoint.every={every}",
                                        "compression.measure_error=false", *extra])


def fit(ctx: ParallelContext, root: Path, run: str, found_in_run: dict[str, Any],
        resume: Optional[Path] = None) -> dict[str, Any]:
    """Train run `run` of `RUNS` through `Trainer.fit`, its config given the values `found_in_run` (what earlier
    runs found: the tolerance, a switch step), validated again; this rank's view of the run."""
    world = ctx.layout.world
    case, extra, every = RUNS[run]
    cfg = fit_cfg(case, world, root, run, extra, every)
    for key, value in found_in_run.items():
        OmegaConf.update(cfg, key, value)
    validate(cfg, world)
    torch.manual_seed(1234 + ctx.pp_rank)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB, n=16),
                      torch.device("cpu"), hook, state, log=lambda _: None)
    found = None
    if resume is not None:
        cfg.checkpoint.resume = str(resume)
        found = plan_resume(cfg, VOCAB, ctx.rank == 0, lambda _: None)
    lines: list[str] = []
    trainer.start(found)
    trainer.metrics.message = lines.append  # every rank's own view of the lines rank 0 prints
    start = trainer.step
    trainer.fit()
    trainer.close()
    bounds = list(state.schedule.bounds) if state.schedule is not None else []
    buckets = trainer.grad_sync.buckets
    kept = [all(p.ndim < 2 for p in b.parameters()) for b in buckets] if "schedule=auto" in " ".join(extra) or \
        any("exact_params" in e for e in extra) else [False] * len(buckets)
    expected = []
    c = cfg.compression
    if c.method == "onebit_adam":
        c.method, c.scale = "sign", "none"  # the momentum's exchange: the sign codec's bytes, no statistics sent
    for step in range(start, STEPS):
        warm = bounds[0] if bounds else cfg.compression.warmup_steps
        payload = 0
        for b, exact in zip(buckets, kept):
            c.warmup_steps = STEPS if exact else warm  # "none" for the kept buckets and the exact stage
            payload += sum(expected_step(c, step, [b], ctx)[0].values())
        c.warmup_steps = warm
        expected.append(payload)
    return {"bounds": bounds, "lines": [ln for ln in lines if ln.startswith("compression:")], "expected": expected,
            "final": [p.detach().clone() for p in trainer.model.parameters()]}


def records(root: Path, run: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


TP2 = Case(tp=2)
AUTO = [*SIGN, "compression.schedule=auto", f"compression.settle_window={WINDOW}"]  # + the tolerance found
ONEBIT = ["compression=onebit_adam", "compression.block_size=64"]
SWITCH = "compression.warmup_steps=1"  # a valid stand-in for the switch step an earlier run finds (set in `fit`)
# run → (case, overrides, checkpoint.every); what depends on earlier runs (the tolerance, a switch step) is set
# on the composed config (`fit`), so that every config is composed before the ranks fork
RUNS: dict[str, tuple[Case, list[str], int]] = {
    "exact": (TP2, ["compression=none"], 0),
    "auto": (TP2, [*AUTO, f"checkpoint.keep={STEPS}"], EVERY),  # every checkpoint kept: two are resumed
    "fixed": (TP2, [*SIGN, "compression.exact_params=[vectors]", SWITCH], 0),  # the auto run's switch
    "resumed": (TP2, AUTO, 0),
    "moved": (Case(), AUTO, 0),
    "onebit": (TP2, [*ONEBIT, "compression.warmup_steps=0", "compression.schedule=auto",
                     f"compression.settle_window={WINDOW}"], 0),
    "onebit_fixed": (TP2, [*ONEBIT, "compression.exact_params=[vectors]", SWITCH], 0),  # the onebit run's switch
}


def schedule_runs(rank: int, world: int, root: Path) -> dict[str, Any]:
    ctx = layout_context(world, TP2)
    out: dict[str, Any] = {"exact": fit(ctx, root, "exact", {})}
    torch.distributed.barrier()
    tol = tolerance_for([r["loss"] for r in records(root, "exact")])
    settle = {"compression.settle_tol": tol}
    out["tol"] = tol
    out["auto"] = fit(ctx, root, "auto", settle)
    switch = out["auto"]["bounds"][0]
    out["fixed"] = fit(ctx, root, "fixed", {"compression.warmup_steps": switch})
    out["resumed"] = fit(ctx, root, "resumed", settle, step_path(root / "auto", EVERY))
    after = EVERY * (switch // EVERY + 1)
    out["after"] = after
    out["moved"] = fit(layout_context(world, Case()), root, "moved", settle, step_path(root / "auto", after))
    out["onebit"] = fit(ctx, root, "onebit", settle)
    out["onebit_fixed"] = fit(ctx, root, "onebit_fixed", {"compression.warmup_steps": out["onebit"]["bounds"][0]})
    return out


def test_auto_schedule_switches_by_its_rule_and_equals_the_warm_up_it_found(tmp_path: Path) -> None:
    for run, (case, extra, every) in RUNS.items():  # composed here once, inherited by the forked ranks
        fit_cfg(case, 4, tmp_path, run, extra, every)
    results = run_ranks(schedule_runs, 4, tmp_path, timeout=TIMEOUT)
    exact = [r["loss"] for r in records(tmp_path, "exact")]
    tol = results[0]["tol"]
    switch = reference_switch(exact, WINDOW, tol)
    assert switch is not None and 2 * WINDOW <= switch < STEPS - 2, (switch, exact)
    auto = records(tmp_path, "auto")
    for r in results:  # every rank decided alike, and said so in one line
        assert r["auto"]["bounds"] == [switch] == r["resumed"]["bounds"] == r["moved"]["bounds"]
        assert len(r["auto"]["lines"]) == 1 and f"none → sign from step {switch + 1}" in r["auto"]["lines"][0]
        assert r["resumed"]["lines"] == [] or "none → sign" in r["resumed"]["lines"][0]
        assert r["moved"]["lines"] == []
        assert all(torch.equal(a, b) for a, b in zip(r["auto"]["final"], r["fixed"]["final"]))
        assert all(torch.equal(a, b) for a, b in zip(r["onebit"]["final"], r["onebit_fixed"]["final"]))
    # step switch + 1's loss comes before its compressed update: the runs part after it
    assert [r["loss"] for r in auto[:switch + 1]] == exact[:switch + 1]
    assert auto[switch + 1]["loss"] != exact[switch + 1]
    assert [r["comm/compression_method"] for r in auto] == ["none"] * switch + ["sign"] * (STEPS - switch)
    assert [r["comm/compression_stage"] for r in auto] == [0] * switch + [1] * (STEPS - switch)
    # bytes per step: the library's formulas
    for name in ("auto", "fixed", "resumed", "moved", "onebit", "onebit_fixed"):
        got = [r["bytes_dp"] for r in records(tmp_path, name)]
        want = np.sum([r[name]["expected"] for r in results], axis=0) / len(results)
        assert got == list(want) or np.allclose(got, want, rtol=1e-12), name
    assert [r["loss"] for r in records(tmp_path, "fixed")] == [r["loss"] for r in auto]
    assert [r["loss"] for r in records(tmp_path, "resumed")] == [r["loss"] for r in auto[EVERY:]]
    moved = records(tmp_path, "moved")
    assert moved[0]["step"] == results[0]["after"] + 1 and {r["comm/compression_method"] for r in moved} == {"sign"}
    onebit = [r["loss"] for r in records(tmp_path, "onebit")]
    assert onebit == [r["loss"] for r in records(tmp_path, "onebit_fixed")]
    assert 2 * WINDOW <= results[0]["onebit"]["bounds"][0] < STEPS
