"""Sharded checkpoints on gloo ranks: exact resume under the same layout, resharded resume under others.

One world-8 launch:
1. trains tp2pp2dp2 for 4 steps uninterrupted, saving at steps 2 and 4 (`checkpoint.every=2`): the
   uninterrupted reference, and the checkpoint;
2. in the same layout, a fresh model and Trainer resume step 2 and train to 4: losses must equal
   steps 3..4 bit for bit (fp32 on CPU; step 4's update runs on the restored Adam moments), and so must
   the final weights;
3. under tp4pp2 (TP split finer), tp2pp4 interleaved with 2 chunks per rank (PP split finer, virtual
   stages) and tp1pp2dp4 with the distributed optimizer (TP merged, DP wider, optimizer state sharded), each
   with new process groups, a fresh model resumes step 2 (pp=1 is the single-process resume below):
   right after loading, the gathered weights must equal the saved run's at step 2 exactly (the real
   vocabulary rows: padding differs with tp), the data position must be step 2's, and the losses of
   steps 3..4 must match the uninterrupted run within float tolerance.
The test process itself then resumes the same checkpoint in a single process (no process group).

One world-2 launch (`run2`) checkpoints three runs, each in its own folder: the same-layout check with dropout
and a stateful compression hook (PowerSGD with error feedback at dp2: bit-exact only if RNG streams and hook
state are restored), the zero-bubble placements, and 1-bit Adam. A world-4 launch checks the async save.
Every launch's configs are composed in the test process before the ranks fork (`resume_cfgs`, `async_cfgs`):
the ranks inherit them (`compose_config`'s memo); its heap is frozen while they run (`run_frozen`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pp_helpers import VOCAB, Case, layout_context, make_cfg
from test_dp import synthetic_corpus
from tp_helpers import run_frozen

from hybrid.checkpoint import plan_resume, step_path
from hybrid.compression.hooks import make_hook
from hybrid.parallel.context import ParallelContext
from hybrid.parallel.params import full_state_dict
from hybrid.trainer import Trainer, build_chunks

STEPS, SAVE_AT = 4, 2  # 2 steps after the save: the second updates with the restored Adam moments
TIMEOUT = 300
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
RESHARDED = [Case(tp=4, pp=2), Case(tp=2, pp=4, schedule="interleaved", v=2),
             Case(tp=1, pp=2, zero=1)]  # the distributed optimizer (dp4) from an unsharded optimizer's checkpoint


def _cfg(case: Case, world: int, root: Path, run: str, *extra: str) -> Any:
    return make_cfg(case, world, extra=[f"train.steps={STEPS}", f"checkpoint.dir={root}", f"run_name={run}",
                                        "optim.warmup_steps=2", *extra])


LOG: list[str] = []  # this rank's checkpoint messages


def _trainer(cfg: Any, ctx: ParallelContext) -> Trainer:
    torch.manual_seed(1234 + ctx.pp_rank)  # the default generator as train.py seeds it per stage
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    return Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"),
                   hook, state, log=LOG.append)


def _train(trainer: Trainer) -> list[float]:
    losses = []
    while trainer.step < trainer.cfg.train.steps:
        losses.append(trainer.train_step().loss)
        trainer.checkpointer.after_step(trainer.step)
    trainer.checkpointer.wait()
    return losses


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This stage's gathered, globally named weights (a collective over TP), real vocabulary rows only."""
    out = {}
    getattr(trainer.optimizer, "wait_params", lambda: None)()  # every parameter readable (ZeRO-3: gathered)
    for chunk in trainer.model:
        for name, t in full_state_dict(chunk, trainer.ctx.tp_group).items():
            out[name] = t[:VOCAB] if name in ("tok_embed.weight", "head.weight") else t
    return out


def _resume(cfg: Any, ctx: ParallelContext, path: Path) -> Trainer:
    cfg.checkpoint.resume = str(path)
    trainer = _trainer(cfg, ctx)
    found = plan_resume(cfg, VOCAB, ctx.rank == 0, lambda _: None)
    assert found is not None and found[0] == path
    trainer.checkpointer.load(*found)
    return trainer


def _record(trainer: Trainer, losses: list[float], loaded: dict[str, torch.Tensor]) -> dict[str, Any]:
    c = trainer.ctx.coord
    return {"coord": (c.pp, c.dp, c.tp), "losses": losses, "loaded": loaded if c.tp == 0 and c.dp == 0 else None}


def resume_cfgs(world: int, root: Path, base: Case, resharded: list[Case], extra: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    """The configs `resume_runs` trains under, by run name ("base", "same", then each resharded case). Called in
    the test process before the ranks fork, it composes them once for every rank (`compose_config`'s memo)."""
    return {"base": _cfg(base, world, root, "base", f"checkpoint.every={SAVE_AT}", *extra),
            "same": _cfg(base, world, root, "same", *extra)} | {
        str(case): _cfg(case, world, root, f"resharded{i}", *extra) for i, case in enumerate(resharded)}


def resume_runs(rank: int, world: int, root: Path, base: Case, resharded: list[Case],
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rank function: the uninterrupted run, the same-layout resume, then each resharded resume; "log": this
    call's checkpoint messages."""
    LOG.clear()
    cfgs = resume_cfgs(world, root, base, resharded, extra)
    ctx = layout_context(world, base)
    first = _trainer(cfgs["base"], ctx)
    saved: dict[str, torch.Tensor] = {}
    losses = []
    while first.step < STEPS:
        losses.append(first.train_step().loss)
        if first.step == SAVE_AT:
            saved = _weights(first)
        first.checkpointer.after_step(first.step)
    first.checkpointer.wait()
    out: dict[str, Any] = {"base": _record(first, losses, saved), "final": _weights(first)}
    path = step_path(root / "base", SAVE_AT)
    again = _resume(cfgs["same"], ctx, path)
    out["same"] = _record(again, _train(again), {})
    out["same_final"] = _weights(again)
    for case in resharded:
        cctx = layout_context(world, case)
        trainer = _resume(cfgs[str(case)], cctx, path)
        loaded, consumed = _weights(trainer), trainer.sampler.consumed_samples
        out[str(case)] = _record(trainer, _train(trainer), loaded) | {"consumed": consumed}
    out["log"] = list(LOG)
    return out


def resume_each(rank: int, world: int, runs: dict[str, tuple[Path, Case, list[Case], tuple[str, ...]]]
                ) -> dict[str, dict[str, Any]]:
    """Rank function: `resume_runs` of each run (root, base, resharded, extra), one after another, by name."""
    return {name: resume_runs(rank, world, *run) for name, run in runs.items()}


def launch_resumes(world: int, runs: dict[str, tuple[Path, Case, list[Case], tuple[str, ...]]]
                   ) -> dict[str, list[dict[str, Any]]]:
    """`resume_each` on `world` ranks, every config composed here first; each run's results by rank."""
    torch.set_num_threads(1)
    for run in runs.values():
        resume_cfgs(world, *run)
    results = run_frozen(resume_each, world, runs, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in runs}


@pytest.fixture(scope="module")
def run8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, launch_resumes(8, {"run8": (root, Case(tp=2, pp=2), RESHARDED, ())})["run8"]


# The world-2 and world-4 runs train smaller models: 2 layers, 4 for zbv (a layer per part at pp2 × 2)
TWO, FOUR = ("model.n_layers=2",), ("model.n_layers=4",)
ZBV = Case(pp=2, schedule="zbv", v=2, extra=("parallel.zb_memory=none",))  # its own order: split
ZB_OTHERS = [Case(pp=2, schedule="zb1p"), Case()]
RNG_HOOK = (*TWO, "model.dropout=0.1", "compression=powersgd", "compression.rank=2")
ONEBIT = (*TWO, "compression=onebit_adam", "compression.warmup_steps=1")  # step 2, before the save, compressed


@pytest.fixture(scope="module")
def run2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The world-2 launch: each run's results by rank."""
    root = tmp_path_factory.mktemp("ckpt2")
    return launch_resumes(2, {"rng": (root / "rng", Case(), [Case(tp=2)], RNG_HOOK),
                              "zb": (root / "zb", ZBV, ZB_OTHERS, FOUR),
                              "onebit": (root / "onebit", Case(), [Case(tp=2)], ONEBIT)})


def _saved(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        if r["base"]["loaded"]:
            merged.update(r["base"]["loaded"])
    merged.pop("head.weight", None)  # the tied head of the last stage: a copy of tok_embed.weight
    return merged


def test_same_layout_resume_is_bit_exact(run8: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in run8[1]:
        base, same = r["base"]["losses"], r["same"]["losses"]
        assert len(base) == STEPS and len(same) == STEPS - SAVE_AT
        assert same == base[SAVE_AT:], (r["base"]["coord"], same, base[SAVE_AT:])
        for name, w in r["final"].items():
            assert torch.equal(r["same_final"][name], w), name


def _check_resharded(label: str, loaded: dict[str, torch.Tensor], losses: list[float],
                     results: list[dict[str, Any]]) -> None:
    saved = _saved(results)
    if "head.weight" in loaded:  # a tied head loads from tok_embed.weight: it must equal it
        assert torch.equal(loaded.pop("head.weight"), loaded["tok_embed.weight"]), label
    assert sorted(loaded) == sorted(saved), label
    for name, w in saved.items():
        assert torch.equal(loaded[name], w), f"{label}: {name} differs right after loading"
    base = results[0]["base"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(base[SAVE_AT:]), **LOSS_TOL)


@pytest.mark.parametrize("case", [str(c) for c in RESHARDED])
def test_resharded_resume_loads_the_saved_weights_and_continues(run8: tuple[Path, list[dict[str, Any]]],
                                                                 case: str) -> None:
    results = run8[1]
    loaded: dict[str, torch.Tensor] = {}
    for r in results:
        loaded.update(r[case]["loaded"] or {})
        assert r[case]["consumed"] == SAVE_AT * 8, "the data position (samples consumed) must survive resharding"
    for r in results:
        _check_resharded(case, dict(loaded), r[case]["losses"], results)


def test_single_process_resume(run8: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = run8
    torch.set_num_threads(1)
    trainer = _resume(_cfg(Case(), 1, root, "single"), ParallelContext.single(), step_path(root / "base", SAVE_AT))
    loaded = _weights(trainer)
    assert trainer.sampler.consumed_samples == SAVE_AT * 8
    _check_resharded("single", loaded, _train(trainer), results)


def test_same_layout_resume_restores_rng_and_hook_state(run2: dict[str, list[dict[str, Any]]]) -> None:
    """Dropout draws and PowerSGD's residuals and warm-started factors continue exactly; under another
    DP size the hook state is dropped with a warning (and training goes on)."""
    results = run2["rng"]
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
    log = " ".join(results[0]["log"])
    assert "layout changed tp1pp1dp2 → tp2pp1dp1" in log and "compression state" in log and "dropped" in log
    assert "dropped" not in " ".join(m for m in results[0]["log"] if "/same" in m)


def test_zero_bubble_checkpoints_resume_exactly_and_under_other_placements(
        run2: dict[str, list[dict[str, Any]]]) -> None:
    """Saved under zbv (the V placement: rank 0 holds the embedding, the last part and the tied head's copy),
    resumed bit-exactly in the same layout, and by global names under zb1p's loop placement and at pp=1."""
    results = run2["zb"]
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        for name, w in r["final"].items():
            assert torch.equal(r["same_final"][name], w), name
    for case in map(str, ZB_OTHERS):
        loaded: dict[str, torch.Tensor] = {}
        for r in results:
            loaded.update(r[case]["loaded"] or {})
        for r in results:
            _check_resharded(case, dict(loaded), r[case]["losses"], results)


ASYNC = Case(tp=2, extra=TWO)  # TP-sharded fused parameters: their part views are staged too


def async_cfgs(world: int, root: Path) -> dict[str, Any]:
    """The configs of `async_runs` by run name (composed in the test process before the ranks fork)."""
    return {"async": _cfg(ASYNC, world, root, "async", "checkpoint.every=2", "checkpoint.keep=2",
                          "checkpoint.async=true"),
            "check": _cfg(ASYNC, world, root, "check"), "again": _cfg(ASYNC, world, root, "again")}


def async_runs(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Async saves every 2 steps (keep 2) while training goes on; then a same-layout resume of the one before
    the last."""
    LOG.clear()
    cfgs = async_cfgs(world, root)
    ctx = layout_context(world, ASYNC)
    first = _trainer(cfgs["async"], ctx)
    losses = _train(first)
    before = _weights(first)
    first.checkpointer.save()  # the last step once more; then change every weight while it is written
    with torch.no_grad():
        for p in first.model.parameters():
            p.add_(1.0)
    first.checkpointer.wait()
    check = _resume(cfgs["check"], ctx, step_path(root / "async", STEPS))
    unchanged = all(torch.equal(w, before[n]) for n, w in _weights(check).items())
    again = _resume(cfgs["again"], ctx, step_path(root / "async", STEPS - 2))
    return {"losses": losses, "resumed": _train(again), "log": list(LOG), "unchanged": unchanged}


def test_async_save_snapshots_the_step_it_was_started_at(tmp_path: Path) -> None:
    """Async saves at steps 2 and 4; then step 4 once more, written by the background thread while training
    runs on (and changes every weight): that checkpoint still holds step 4's state exactly. Resuming step 2
    reproduces steps 3..4 bit for bit; keep=2 leaves the newest two, step 2 and step 4."""
    torch.set_num_threads(1)
    async_cfgs(4, tmp_path)
    results = run_frozen(async_runs, 4, tmp_path, timeout=TIMEOUT)
    for r in results:
        assert r["resumed"] == r["losses"][STEPS - 2:]
        assert r["unchanged"], "the async save wrote weights changed after it was started"
    kept = ["latest", f"step_{STEPS - 2:07d}", f"step_{STEPS:07d}"]
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == kept
    assert (tmp_path / "async" / "latest").resolve() == (tmp_path / "async" / f"step_{STEPS:07d}").resolve()
    log = results[0]["log"]
    assert sum("async" in m and "saved" in m for m in log) == STEPS // 2 + 1


def test_onebit_adam_resumes_exactly_and_under_another_dp_size(run2: dict[str, list[dict[str, Any]]]) -> None:
    """1-bit Adam's state through the real checkpoint: the same layout continues bit for bit (momentum,
    frozen variance and the per-rank residuals restored); dp2 → tp2 (dp1) loads the same weights and goes on
    from the saved momentum and frozen variance: at dp1 the momentum is exact, not sign-compressed, so the
    losses differ (the update itself is checked against the reference in test_onebit_adam.py)."""
    results = run2["onebit"]
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        assert all(torch.equal(r["same_final"][name], w) for name, w in r["final"].items())
    saved, moved = _saved(results), results[0][str(Case(tp=2))]
    assert all(torch.equal(moved["loaded"][k], v) for k, v in saved.items())
    base = results[0]["base"]["losses"][SAVE_AT:]
    assert abs(moved["losses"][0] - base[0]) < 1e-5  # the loaded weights' forward
    assert all(abs(a - b) < 0.1 * b for a, b in zip(moved["losses"], base)), (moved["losses"], base)
