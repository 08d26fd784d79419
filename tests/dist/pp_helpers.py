"""Shared pieces of the pipeline-parallel rank tests (test_pp, test_pp_torch).

One tiny model (8 layers so that pp=4 with 2 virtual stages has a layer per part; a case may ask for
fewer, `Case.layers`, and is then held to the single-process run of that many), one corpus,
one config builder for every (tp, pp, dp, schedule, virtual stages, sequence parallel) case,
and `train_cases`: the rank function that trains a list of cases one after another in a single
launch (each case builds a fresh model and Trainer; the process groups are built once per
layout and shared), returning for each case the losses, gradient norms, per-step bytes per group, the DP
bucket launch log, the eval loss and this stage's gathered (TP-full, globally named) weights.
The single-process reference is the same function with tp = pp = dp = 1.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch._dynamo  # noqa: F401  (AdamW imports it lazily, ~3 CPU-s: once here, not in every forked rank)
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from test_dp import SEQ, synthetic_corpus

from hybrid.compression.hooks import make_hook
from hybrid.config import compose_config
from hybrid.model import analytic_param_count
from hybrid.optim import DistributedOptimizer
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.params import full_state_dict, param_info
from hybrid.trainer import Trainer, build_chunks
from hybrid.validation import validate

VOCAB = 201  # with make_vocab_size_divisible_by=1: padded to 202 at tp=2 (not divisible by tp)
LAYERS = 8
GLOBAL_BATCH = 8
MICRO = 2  # 4 microbatches at dp=1, 2 at dp=2
STEPS = 2  # the second step's loss, norm and the final weights already depend on the first update
TIMEOUT = 150
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}
# Adam's early steps move a weight by about lr·g/|g| (lr = 3e-3), so an element whose gradient is
# near zero turns fp32 round-off of that gradient into a visible weight difference: up to 1.4e-5
# is seen already at tp2 without any pipeline. A wrong gradient would move weights by ~lr.
WEIGHT_TOL = {"rtol": 1e-4, "atol": 5e-5}
MODEL_CONFIGS = {"gpt": "gpt-tiny", "llama": "llama-tiny"}  # another registered family: gpt-tiny's sizes


@dataclass(frozen=True)
class Case:
    """One training run: the model family and the parallel layout (dp = world / (tp·pp))."""

    family: str = "gpt"
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    v: int = 1  # virtual stages (interleaved)
    sp: bool = False
    stage_layers: Optional[tuple[int, ...]] = None  # parallel.stage_layers; None = balanced
    zero: int = 0  # parallel.zero: 1 = the distributed optimizer
    extra: tuple[str, ...] = ()  # more overrides
    layers: int = LAYERS  # model.n_layers

    def __str__(self) -> str:
        sp = "sp" if self.sp else ""
        v = f"v{self.v}" if self.v > 1 else ""
        parts = "-" + "_".join(map(str, self.stage_layers)) if self.stage_layers else ""
        layers = f"-{self.layers}L" if self.layers != LAYERS else ""
        return (f"{self.family}{layers}-tp{self.tp}pp{self.pp}{sp}-{self.schedule}{v}{parts}"
                f"{f'-zero{self.zero}' if self.zero else ''}" + (f"-{','.join(self.extra)}" if self.extra else ""))


def make_cfg(case: Case, world: int, bucket_mb: float = 0.15, extra: Sequence[str] = ()) -> Any:
    """The composed (and validated) config of `case` on `world` ranks: fp32, no dropout, and clipping
    at 0.05, below every step's gradient norm (~2-3), so each update is scaled by the global norm. Gradient
    buckets of 0.15 MB: two or more per stage of the tiny models; each is one exchange, which costs this machine's
    gloo ~2 ms of CPU per rank.

    Each call gets its own copy; Hydra composes each set of config groups once per process (`composed`) and
    the validation runs once per (overrides, world), so a config made in the test process before the ranks fork
    costs them nothing."""
    dp = world // (case.tp * case.pp)
    overrides = (
        f"model={MODEL_CONFIGS.get(case.family, 'gpt-tiny')}", f"model.family={case.family}",
        f"model.n_layers={case.layers}",
        "model.hidden=64", "model.n_heads=4", "model.ffn_hidden=128", "model.max_seq_len=32",
        "model.make_vocab_size_divisible_by=1", "model.dropout=0.0",
        f"data.seq_len={SEQ}", f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO}",
        f"train.steps={STEPS}", "train.eval_every=0", "train.eval_batches=1", "train.lr=3e-3",
        "train.precision=fp32", "train.device=cpu", "optim.warmup_steps=1", "optim.grad_clip=0.05",
        f"parallel.tp={case.tp}", f"parallel.pp={case.pp}", f"parallel.dp={dp}",
        f"parallel.schedule={case.schedule}", f"parallel.virtual_stages={case.v}",
        f"parallel.sequence_parallel={str(case.sp).lower()}", f"parallel.bucket_mb={bucket_mb}",
        f"parallel.zero={case.zero}",
        "parallel.name=test", *case.extra, *extra,
        *([f"parallel.stage_layers=[{','.join(map(str, case.stage_layers))}]"] if case.stage_layers else []),
    )
    _validated(overrides, world)
    return composed(overrides)


_COMPOSED: dict[tuple[str, ...], bytes] = {}  # overrides → the config, pickled (as `compose_config`'s memo)


def composed(overrides: Sequence[str]) -> Any:
    """`compose_config(overrides)` for overrides that name config groups (`model=…`, `compression=…`) and set
    values (`model.hidden=64`): Hydra composes the groups (~0.3 CPU-s, once per set of groups in a process), then
    the values are applied as Hydra applies them (its parser, `OmegaConf.update(…, merge=True)`, after the
    groups), so the cases that differ only in values share one composition. Each call gets its own copy."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        groups = tuple(o for o in key if "." not in o.split("=", 1)[0])
        cfg = compose_config(groups)
        for o in OverridesParser.create().parse_overrides([o for o in key if o not in groups]):
            assert not (o.is_add() or o.is_delete() or o.is_force_add() or o.package is not None), o.input_line
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
        _COMPOSED[key] = pickle.dumps(cfg)
    return pickle.loads(_COMPOSED[key])


@functools.cache
def _validated(overrides: tuple[str, ...], world: int) -> None:
    """`validate` the config of `overrides` on `world` ranks (raises ConfigError; a success is remembered)."""
    validate(composed(overrides), world)


def train_case(ctx: ParallelContext, case: Case, world: int) -> dict[str, Any]:
    """Train `case` for STEPS steps on this rank, then evaluate once."""
    cfg = make_cfg(case, world)
    model = build_chunks(cfg, VOCAB, ctx)
    hook, state = make_hook(cfg.compression, ctx.dp_group)
    trainer = Trainer(cfg, ctx, model, synthetic_corpus(vocab=VOCAB), torch.device("cpu"), hook, state)
    losses, norms, step_bytes, launch_logs = [], [], [], []
    for _ in range(cfg.train.steps):
        C.COUNTER.reset()
        r = trainer.train_step()
        inflight = len(getattr(trainer.optimizer, "_inflight", {}))  # ZeRO-1's all-gathers left to the forward
        losses.append(r.loss)
        norms.append(r.grad_norm)
        step_bytes.append({key: b for key, b in C.COUNTER.bytes.items() if b})
        launch_logs.append(list(trainer.grad_sync.last_launch_log))
    units = getattr(trainer.optimizer, "units", None)  # ZeRO-3: the kept shards; what a step leaves gathered
    zero3 = None if units is None else {"kept": sum(f.shard.nbytes for f in units.flats()),
                                        "gathered": sum(f.nbytes for f in units.flats() if f.gathered),
                                        "units": [(u.root, sum(f.full.numel() for f in u.flats)) for u in units.units],
                                        "flats": [(u.root, f.full.numel()) for u in units.units for f in u.flats]}
    eval_loss = trainer.evaluate()
    full: dict[str, torch.Tensor] = {}
    getattr(trainer.optimizer, "wait_params", lambda: None)()  # every parameter readable (ZeRO-3: gathered)
    for chunk in model:  # a collective over TP: every TP rank gathers
        full.update(full_state_dict(chunk, ctx.tp_group))
    c = ctx.coord
    tied = sum(p.numel() for p in model.parameters() if param_info(p).pp_tied)  # this rank's shard
    return {"case": str(case), "coord": (c.pp, c.dp, c.tp), "losses": losses, "norms": norms,
            "bytes": step_bytes, "launch_logs": launch_logs, "buckets": len(trainer.grad_sync.buckets),
            "microbatches": trainer.num_microbatches, "grad_bytes": trainer.grad_sync.held_bytes(),
            "grads_none": all(p.grad is None for p in model.parameters()),
            "eval": eval_loss, "tied_numel": tied, "inflight": inflight, "zero3": zero3,
            "n_params": trainer.n_params, "analytic_params": analytic_param_count(cfg.model, VOCAB, case.tp),
            "state": full if c.tp == 0 and c.dp == 0 else None, "moments": moment_bytes(trainer.optimizer),
            "bucket_numel": [(sum(p.numel() for p in b.parameters()), b.numel())
                             for b in trainer.grad_sync.buckets]}


def moment_bytes(optimizer: Any) -> tuple[int, int]:
    """Bytes of Adam moments this rank updates (its parameters' or, under ZeRO-1, its fragments') and
    allocates (under ZeRO-1 the flat shards, padding included)."""
    inner = optimizer.optimizer
    held = sum(t.numel() * t.element_size() for s in inner.state.values() for k, t in s.items() if k != "step")
    if not isinstance(optimizer, DistributedOptimizer):
        return held, held
    return held, sum(t.numel() * t.element_size() for sb in optimizer.buckets for t in sb.moments.values())


def layout_context(world: int, case: Case) -> ParallelContext:
    """The groups of `case`'s layout on `world` ranks (built now, all named); one process: no groups."""
    if world == 1:
        return ParallelContext.single()
    return ParallelContext.build(Layout.create(world, tp=case.tp, pp=case.pp, ranks_per_node=node_size(case) or None))


def node_size(case: Case) -> int:
    """The emulated node size a case's overrides set (`parallel.ranks_per_node=N`), or 0 (the world is one)."""
    sizes = [int(e.split("=")[1]) for e in case.extra if e.startswith("parallel.ranks_per_node=")]
    return sizes[0] if sizes else 0


def train_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Rank function: train each case in turn (groups built once per (tp, pp) layout, all named)."""
    contexts: dict[tuple[int, int, int], ParallelContext] = {}
    out = []
    for case in cases:
        key = (case.tp, case.pp, node_size(case))
        if key not in contexts:
            contexts[key] = layout_context(world, case)
        out.append(train_case(contexts[key], case, world))
    return out


@functools.cache
def reference(family: str, layers: int = LAYERS) -> dict[str, Any]:
    """The single-process run (tp = pp = dp = 1: the global batch as 4 microbatches of MICRO)."""
    torch.set_num_threads(1)
    r = train_case(ParallelContext.single(), Case(family, layers=layers), 1)
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert r["n_params"] == r["analytic_params"]
    return r


def stage_states(results: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """Each pipeline stage's gathered weights (from its TP rank 0 of DP rank 0), by stage."""
    by_stage = {r["coord"][0]: r["state"] for r in results if r["state"] is not None}
    return [by_stage[s] for s in sorted(by_stage)]


def assert_matches_reference(results: list[dict[str, Any]], ref: dict[str, Any],
                             errors: Optional[dict[str, float]] = None) -> None:
    """Every rank's losses and norms, and the union of the stages' weights, match the
    single-process run; a tied head (last stage) equals the first stage's embedding bit for bit."""
    where = results[0]["case"]
    for r in results:
        for key, tol in (("losses", LOSS_TOL), ("norms", NORM_TOL)):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ref[key]), **tol,
                                       msg=lambda m, k=key, c=r["coord"]: f"{where} {k} at {c}: {m}")
        # the whole model's parameters, counted once over TP shards and stages (tied head excluded)
        assert r["n_params"] == r["analytic_params"], (where, r["coord"], r["n_params"], r["analytic_params"])
        track(errors, "loss", r["losses"], ref["losses"])
        track(errors, "norm", r["norms"], ref["norms"])
    stages = stage_states(results)
    merged: dict[str, torch.Tensor] = {}
    for s in stages:
        overlap = set(merged) & set(s)
        assert not overlap, f"{where}: parameters held by two stages: {sorted(overlap)}"
        merged.update(s)
    tied = len(stages) > 1 and "head.weight" not in ref["state"]
    if tied:
        head = next(s["head.weight"] for s in stages if "head.weight" in s)  # the last part's stage (V: the first)
        embed = next(s["tok_embed.weight"] for s in stages if "tok_embed.weight" in s)
        assert torch.equal(head, embed), f"{where}: the last part's tied head drifted from the first's embedding"
        merged.pop("head.weight")
    assert sorted(merged) == sorted(ref["state"]), f"{where}: {sorted(set(merged) ^ set(ref['state']))}"
    for name, w in ref["state"].items():
        mine = merged[name]
        if name in ("tok_embed.weight", "head.weight"):  # padded rows differ in count between layouts
            mine, w = mine[:VOCAB], w[:VOCAB]
        torch.testing.assert_close(mine, w, **WEIGHT_TOL, msg=lambda m, n=name: f"{where} {n}: {m}")
        track(errors, "weight", mine, w)


def track(errors: Optional[dict[str, float]], key: str, ours: Any, ref: Any) -> None:
    if errors is not None:
        diff = (torch.as_tensor(ours, dtype=torch.float64) - torch.as_tensor(ref, dtype=torch.float64)).abs().max()
        errors[key] = max(errors.get(key, 0.0), float(diff))
