"""Replica-level sync modes (`hybrid.sync`) on gloo ranks, against references: synchronous DP (DiLoCo with H=1,
outer lr 1 and no momentum under a linear inner optimizer is gradient averaging), a DiLoCo loop written here from
the paper's pseudo-code over single-process trainers, and the byte counts of the DP exchanges they replace.

A pipelined model has 2 layers (`SMALL`: a layer per stage), and so has the one DiLoCo trains against the
paper's loop; the other DP-only ones have 1 (`ONE`). The pipelined runs take one microbatch per replica and step
(`ONE_MICRO`). One launch per world size, each run once per session and read by several tests; every config is
composed in the test process before the ranks fork (`compose_config`'s memo), whose heap is frozen while they
run (`run_frozen`):
  - world 4 (`four`): the averaging modes and the parameter servers against one synchronous-DP run, the
    asynchronous server with a slow worker, gossip on a 4-rank ring of toy quadratics, and the DiLoCo, gossip
    and parameter server checkpoints at tp1pp2dp2 (each saved, resumed and exported in its own folder; a
    checkpoint's replica state is per rank, so 4 ranks with two stages and two replicas show what 8 would);
  - world 2: DiLoCo against the paper's loop (the references computed in the test process);
  - world 8, tp2pp2dp2 (`eight`): the byte counts of every outer step (TP, PP and DP traffic side by side).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pp_helpers import VOCAB, Case, make_cfg
from safetensors.torch import load_file
from test_checkpoint import SAVE_AT, STEPS, resume_cfgs, resume_runs
from test_dp import synthetic_corpus
from tp_helpers import run_frozen

from hybrid.checkpoint import step_path
from hybrid.compression.hooks import make_hook
from hybrid.model.hf import to_hf_state_dict
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.params import full_state_dict
from hybrid.sampler import StepSampler
from hybrid.sync.outer import even_parts, fragments_of, largest_share
from hybrid.sync.outer_policy import pinned
from hybrid.tools.export import Options, export
from hybrid.trainer import Trainer, build_chunks

TIMEOUT = 300
LINEAR = ("optim=sgd", "optim.grad_clip=0")  # SGD with momentum, no clipping: linear in the gradients
AVERAGE = ("sync=diloco", "sync.inner_steps=1", "sync.outer_lr=1", "sync.outer_momentum=0", "sync.nesterov=false")
DILOCO = ("sync=diloco", "sync.inner_steps=3", "sync.outer=nesterov")  # the paper's: Nesterov, lr 0.7, momentum 0.9
SMALL = ("model.n_layers=2",)  # every pipelined model here (a layer per pipeline stage)
ONE = ("model.n_layers=1",)  # every DP-only model here
DP_ONLY, TP2PP2 = Case(extra=ONE), Case(tp=2, pp=2, extra=SMALL)
PAPER = Case(extra=SMALL)  # DiLoCo against the paper's loop: 2 layers (with 1, AdamW's step on an element whose
# gradient is rounding noise tells the two sum orders apart beyond the 1e-6 the comparison allows)


def _trainer(cfg: Any, ctx: ParallelContext) -> Trainer:
    torch.manual_seed(1234 + ctx.pp_rank)
    hook, state = make_hook(cfg.compression, ctx.dp_group, ctx.dp_intra_group, ctx.dp_inter_group)
    return Trainer(cfg, ctx, build_chunks(cfg, VOCAB, ctx), synthetic_corpus(vocab=VOCAB), torch.device("cpu"),
                   hook, state)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for chunk in trainer.model:
        out.update(full_state_dict(chunk, trainer.ctx.tp_group))
    return out


def mode_cfg(case: Case, world: int, extra: tuple[str, ...], ranks_per_node: int, steps: int) -> Any:
    """The config `train_modes` trains mode `extra` under."""
    return make_cfg(case, world, extra=[*extra, f"train.steps={steps}", f"parallel.ranks_per_node={ranks_per_node}"])


def modes_composed(case: Case, world: int, modes: list[tuple[str, ...]], ranks_per_node: int, steps: int) -> None:
    """Compose every mode's config in the test process, so the forked ranks inherit them."""
    for extra in modes:
        mode_cfg(case, world, extra, ranks_per_node, steps)


def train_modes(rank: int, world: int, case: Case, modes: list[tuple[str, ...]], ranks_per_node: int,
                steps: int) -> list[dict[str, Any]]:
    """Rank function: each mode (its overrides) trained `steps` steps; losses, weights, DP bytes per step."""
    ctx = ParallelContext.build(Layout.create(world, tp=case.tp, pp=case.pp, ranks_per_node=ranks_per_node))
    out = []
    for extra in modes:
        cfg = mode_cfg(case, world, extra, ranks_per_node, steps)
        trainer = _trainer(cfg, ctx)
        losses, dp_bytes = [], []
        for _ in range(steps):
            C.COUNTER.reset()
            losses.append(trainer.train_step().loss)
            dp_bytes.append({g: C.COUNTER.group_bytes(g) for g in ("dp", "dp_intra", "dp_inter", "tp", "pp")})
        numel = sum(p.numel() for p in trainer.grad_sync.parameters())
        out.append({"losses": losses, "weights": _weights(trainer), "bytes": dp_bytes, "numel": numel,
                    "record": trainer.dp.replica_record(steps)})
    return out


# ---- the world-4 and world-8 launches -------------------------------------------------------------------------

AVERAGING = [(*LINEAR, *AVERAGE), (*LINEAR, *AVERAGE, "sync.scope=inter"),
             (*LINEAR, "sync=gossip", "sync.topology=complete")]  # on 2 emulated nodes × 2
SERVERS = [(*LINEAR, "sync=ps"), (*LINEAR, "sync=ps", "sync.servers=3"),
           (*LINEAR, "sync=ps_async", "sync.max_staleness=0")]  # on one node of 4
STALE_K, STALE_STEPS = 2, 8
RING_ROUNDS, RING_LR = 3, 0.1  # each round shrinks the distance to 0.3×: 3 rounds stay far above fp32 round-off


ONE_MICRO = ("train.global_batch_size=4",)  # at dp=2: one microbatch (of 2) per replica and step
CKPT = Case(tp=1, pp=2, extra=(*SMALL, *ONE_MICRO))  # the checkpointed runs' layout at world 4: tp1pp2dp2
# name → (mode, the layouts a resume restarts under); saved and resumed at tp1pp2dp2 in folder <root>/<name>
RESUMED: dict[str, tuple[tuple[str, ...], list[Case]]] = {
    "diloco": ((*DILOCO, "sync.fragments=3", "sync.overlap_steps=1", "compression=powersgd", "compression.rank=2"),
               [Case(tp=2, pp=1, extra=(*SMALL, *ONE_MICRO))]),
    "gossip": (("sync=gossip",), []),
    "ps": (("sync=ps", "sync.servers=2"), []),
}


def four_ranks(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Rank function of the world-4 launch: synchronous DP and the averaging modes (4 steps), the parameter
    servers (4 steps), the asynchronous server with a slow worker, ring gossip on toy quadratics, then each
    checkpointed mode at tp1pp2dp2."""
    out = {"averaging": train_modes(rank, world, DP_ONLY, [LINEAR, *AVERAGING], 2, 4),
           "servers": train_modes(rank, world, DP_ONLY, SERVERS, 4, 4),
           "stale": staleness_run(rank, world, STALE_K, STALE_STEPS),
           "ring": ring_rounds(rank, world, RING_ROUNDS, RING_LR)}
    for name, (mode, resharded) in RESUMED.items():
        out[name] = resume_runs(rank, world, root / name, CKPT, resharded, mode)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """(the checkpoints' root, the world-4 launch's results by rank)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sync4")
    modes_composed(DP_ONLY, 4, [LINEAR, *AVERAGING], 2, 4)
    modes_composed(DP_ONLY, 4, SERVERS, 4, 4)
    stale_cfg(4, STALE_K, STALE_STEPS)
    for name, (mode, resharded) in RESUMED.items():
        resume_cfgs(4, root / name, CKPT, resharded, mode)
    return root, run_frozen(four_ranks, 4, root, timeout=2 * TIMEOUT)


BYTES_STEPS = 5
BYTES_MODES = [(*ONE_MICRO, *mode) for mode in
               [(), DILOCO, ("compression=int8",), (*DILOCO, "compression=int8"), ("sync=gossip",)]]


@pytest.fixture(scope="module")
def eight() -> list[dict[str, Any]]:
    """The world-8 launch's results by rank (tp2pp2dp2): every byte-count mode."""
    torch.set_num_threads(1)
    modes_composed(TP2PP2, 8, BYTES_MODES, 8, BYTES_STEPS)
    return run_frozen(train_modes, 8, TP2PP2, BYTES_MODES, 8, BYTES_STEPS, timeout=2 * TIMEOUT)


def test_diloco_with_one_inner_step_and_plain_averaging_is_synchronous_dp(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    """H=1, outer lr 1, no momentum, SGD inside: every step averages the replicas' updates, which is averaging
    their gradients — over all of DP, and hierarchically (the node's DP every step, the other node's at each
    outer step) on 2 emulated nodes × 2; gossip on the complete graph (uniform weights) averages too. All equal
    synchronous DP within fp32 rounding."""
    for r in four[1]:
        dp, *others = r["averaging"]
        inter = others[1]["bytes"]  # the node's DP every step, the other node only at the outer steps
        assert all(b["dp"] == 0 and b["dp_intra"] > 0 and b["dp_inter"] > 0 for b in inter)
        for other in others:
            torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(dp["losses"]), rtol=1e-5, atol=1e-6)
            for name, w in dp["weights"].items():
                torch.testing.assert_close(other["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_every_outer_step_costs_one_dp_steps_bytes_and_only_on_its_steps(eight: list[dict[str, Any]]) -> None:
    """At tp2pp2dp2, fp32 and int8: the outer exchange of a rank's parameters counts the bytes a synchronous DP
    step's gradient exchange of the same codec counts, on steps H, 2H, … (and the run's last) only; TP and PP
    traffic per step is synchronous DP's. (Under PowerSGD the tied embedding's two copies end equal: the DiLoCo
    checkpoint test.)"""
    steps = BYTES_STEPS
    results = eight
    syncs = sum(s % 3 == 0 or s == steps for s in range(1, steps + 1))
    for pair in ((0, 1), (2, 3)):  # the record's bytes: the mean over ranks (stages hold different shares)
        mean_dp = sum(r[pair[0]]["bytes"][0]["dp"] for r in results) / len(results)
        assert results[0][pair[1]]["record"]["bytes_outer_per_step"] == pytest.approx(mean_dp * syncs / steps)
    for r in results:
        gossip = r[4]  # dp=2: the ring's one neighbour, every step a rank's fp32 parameters once
        assert [b["dp"] for b in gossip["bytes"]] == [4 * gossip["numel"]] * steps
        assert [b["tp"] for b in gossip["bytes"]] == [b["tp"] for b in r[0]["bytes"]]
        for dp, diloco in ((r[0], r[1]), (r[2], r[3])):
            per_step = dp["bytes"][0]["dp"]
            assert per_step > 0 and all(b["dp"] == per_step for b in dp["bytes"])
            due = [s % 3 == 0 or s == steps for s in range(1, steps + 1)]
            assert [b["dp"] for b in diloco["bytes"]] == [per_step if d else 0 for d in due]
            for group in ("tp", "pp"):
                assert [b[group] for b in diloco["bytes"]] == [b[group] for b in dp["bytes"]]
            assert diloco["record"]["sync_events"] == sum(due)
        assert r[1]["bytes"][-1]["dp"] == 4 * r[1]["numel"]  # fp32: a rank's parameters, once


# ---- DiLoCo against the paper's loop -------------------------------------------------------------------------

def replicas_reference(cfg: Any, dp: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """DiLoCo (Douillard et al. 2023, Algorithm 1; streaming and overlapped as in Streaming DiLoCo) over `dp`
    single-process replicas, each a Trainer reading its DP shard: H inner steps each; per fragment f due at this
    step (t ≡ ⌊(f+1)H/F⌋ mod H, or the last step) Δ = mean over replicas of θ_anchor − θ_r, which lands τ steps
    later (at once when τ = 0): m ← μm + Δ; θ_anchor ← θ_anchor − lr(Δ + μm); θ_r ← α·θ_r + (1 − α)·θ_anchor.
    The last step: what is in flight lands on the anchor alone (α = 1), then every fragment's exchange lands at
    once (α = 0)."""
    s, (lr, mu) = cfg.sync, pinned(cfg.sync)
    one = copy.deepcopy(cfg)
    one.sync.mode, one.sync.inner_steps, one.sync.fragments = "dp", 1, 1
    one.sync.overlap_steps, one.sync.overlap_mix = 0, 0.0
    one.train.global_batch_size //= dp
    replicas = []
    for r in range(dp):
        t = _trainer(one, ParallelContext.single())
        t.sampler = StepSampler(len(t.corpus.train), one.train.micro_batch_size, t.num_microbatches, dp, r,
                                one.train.seed)
        replicas.append(t)
    params = [[p for p in r.model.parameters() if p.requires_grad] for r in replicas]
    n = len(params[0])
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(a) for a in anchor]
    total = sum(p.numel() for p in params[0])
    frag, seen = [], 0
    for p in params[0]:  # F fragments of about equal size, contiguous in the model's order (by middle element)
        frag.append(min(s.fragments - 1, (2 * seen + p.numel()) * s.fragments // (2 * total)))
        seen += p.numel()

    @torch.no_grad()
    def land(f: int, deltas: dict[int, torch.Tensor], mix: float) -> None:
        for i in (i for i in range(n) if frag[i] == f):
            momentum[i] = mu * momentum[i] + deltas[i]
            update = deltas[i] + mu * momentum[i] if s.nesterov else momentum[i]
            anchor[i] = anchor[i] - lr * update
            for r in range(dp):
                params[r][i].copy_(mix * params[r][i] + (1 - mix) * anchor[i])

    pending: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}
    for step in range(1, steps + 1):
        for r in replicas:
            r.train_step()
        last = step == steps
        for f in [f for f, (at, _) in pending.items() if last or step == at + s.overlap_steps]:
            land(f, pending.pop(f)[1], 1.0 if last else s.overlap_mix)
        due = [f for f in range(s.fragments)
               if step % s.inner_steps == (f + 1) * s.inner_steps // s.fragments % s.inner_steps or last]
        for f in due:
            with torch.no_grad():
                pending[f] = (step, {i: sum(anchor[i] - params[r][i] for r in range(dp)) / dp
                                     for i in range(n) if frag[i] == f})
            if last or not s.overlap_steps:
                land(f, pending.pop(f)[1], 0.0)
    return [_weights(r) for r in replicas]


def test_diloco_matches_the_papers_loop() -> None:
    """dp=2, AdamW inside (its state each replica's own), 8 steps at H=3 (the last a partial round ended by the
    final sync): every replica ends with the reference's anchor — whole, streamed in 2 fragments, and streamed
    with overlapped exchanges (τ = 1 mixing the local weights in by α = 0.5; τ = 2 taking the global's)."""
    modes = [DILOCO, (*DILOCO, "sync.fragments=2"),
             (*DILOCO, "sync.fragments=2", "sync.overlap_steps=1", "sync.overlap_mix=0.5"),
             (*DILOCO, "sync.overlap_steps=2")]
    steps = 8
    torch.set_num_threads(1)
    modes_composed(PAPER, 2, modes, 2, steps)
    results = run_frozen(train_modes, 2, PAPER, modes, 2, steps, timeout=TIMEOUT)
    for i, mode in enumerate(modes):
        ref = replicas_reference(mode_cfg(PAPER, 2, mode, 2, steps), 2, steps)
        for r, want in zip(results, ref):
            for name, w in want.items():
                torch.testing.assert_close(r[i]["weights"][name], w, rtol=1e-5, atol=1e-6, msg=(mode, name))
        for name, w in results[0][i]["weights"].items():
            assert torch.equal(results[1][i]["weights"][name], w), (mode, name)  # the final sync: one model
    assert results[0][3]["losses"] != results[0][0]["losses"]  # the overlap changes the training


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_every_stage_keeps_every_fragment_and_the_tied_copies_in_the_first(n: int) -> None:
    """pp=2 with a large vocabulary (the tied embedding outweighs a stage's layers): both stages cut n fragments
    (some empty), so fragment f's outer steps fall on the same steps on both, and each stage's embedding copy is
    in fragment 0 — the tied copies' exchanges pair up. A scope=inter share: contiguous, about 1/r each."""
    cfg = make_cfg(Case(pp=2), 2)
    layout = Layout.create(2, pp=2)
    for rank in (0, 1):
        with torch.device("meta"):
            chunks = build_chunks(cfg, 50_000, ParallelContext.shapes(layout, rank))
        params = [p for p in chunks.parameters() if p.requires_grad]
        frags = fragments_of(params, n)
        assert len(frags) == n and [p for f in frags for p in f] != [] and sorted(map(id, params)) == sorted(
            id(p) for f in frags for p in f)
        assert any(p.numel() >= 50_000 * 64 for p in frags[0])  # this stage's copy of the embedding
    sizes = [p.numel() for p in params]
    assert largest_share(sizes, 2) < sum(sizes) and even_parts(sizes, 2) == sorted(even_parts(sizes, 2))


# ---- the parameter server ----------------------------------------------------------------------------------

def test_parameter_server_synchronous_and_async_at_zero_staleness_are_synchronous_dp(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    """dp=4, momentum SGD on the servers, no clipping (each worker would clip its own gradient): one server
    shard, three, and the asynchronous protocol held to staleness 0 all train as synchronous DP (the servers
    apply the same optimizer to the mean gradient). AdamW would too, but its update divides by √v, and on the
    elements whose gradient is only rounding noise (a key's bias: softmax ignores it) two sum orders differ."""
    for r in four[1]:
        dp, others = r["averaging"][0], r["servers"]  # the one synchronous-DP run of the launch
        for other in others:
            torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(dp["losses"]), rtol=1e-5, atol=1e-6)
            for name, w in dp["weights"].items():
                torch.testing.assert_close(other["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
            assert all(b["dp"] == 0 for b in other["bytes"])  # no DP collective: pushes and replies only


def stale_cfg(world: int, k: int, steps: int) -> Any:
    return make_cfg(DP_ONLY, world, extra=["sync=ps_async", f"sync.max_staleness={k}", "sync.servers=2",
                                           f"train.steps={steps}"])


def staleness_run(rank: int, world: int, k: int, steps: int) -> dict[str, Any]:
    """Rank function: asynchronous PS with max_staleness k; rank 3 sleeps after each step (a slow worker)."""
    import time

    ctx = ParallelContext.build(Layout.create(world))
    trainer = _trainer(stale_cfg(world, k, steps), ctx)
    versions = []
    for _ in range(steps):
        trainer.train_step()
        versions.append((trainer.step, trainer.optimizer.version))
        if rank == 3:
            time.sleep(0.05)
    server = trainer.optimizer.server
    return {"versions": versions, "staleness": list(server.staleness) if server else [],
            "final": _weights(trainer)}


def test_async_parameter_server_never_applies_a_gradient_older_than_k_versions(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    """dp=4, 2 server shards, k=2, rank 3 slow: the fast workers run ahead (some gradients are stale), none is
    more than k versions old when applied, no worker ever holds parameters more than k versions behind its
    clock, and the last step waits for the final version: every replica ends with the same model."""
    k, steps = STALE_K, STALE_STEPS
    results = [r["stale"] for r in four[1]]
    applied = [s for r in results[:2] for s in r["staleness"]]  # the hosts of the two shards
    assert len(applied) == 2 * 4 * steps and max(applied) <= k and max(applied) > 0
    for r in results:
        assert all(step - version <= k for step, version in r["versions"][:-1])
        assert r["versions"][-1] == (steps, steps)
        for name, w in results[0]["final"].items():
            assert torch.equal(r["final"][name], w), name


# ---- gossip on a toy quadratic ----------------------------------------------------------------------------------

class _Plain:
    """The inner optimizer's view of plain tensors (what `Gossip` reads and writes)."""

    state: dict = {}
    moments: tuple[str, ...] = ()

    def main_weight(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p.data

    def loaded(self) -> None:
        pass


def ring_rounds(rank: int, world: int, rounds: int, lr: float) -> list[float]:
    """Rank function: f_i(x) = ½‖x − c‖², a gradient step of `lr`, then a ring round; the consensus distances."""
    from hybrid.config import SyncConfig
    from hybrid.sync.gossip import Gossip

    c = torch.arange(8.0)
    x = torch.nn.Parameter(c + torch.cos(torch.tensor(2 * torch.pi * rank / world)) * torch.ones(8))
    g = Gossip(SyncConfig(mode="gossip", topology="ring"), [x], dist.group.WORLD, _Plain(), None, None)
    out = [g.consensus_distance()]
    for step in range(1, rounds + 1):
        with torch.no_grad():
            x -= lr * (x - c)
        g.after_step(step)
        out.append(g.consensus_distance())
    return out


def test_gossip_on_a_ring_shrinks_the_consensus_distance_as_theory_says(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    """4 replicas on a ring (weights 1/3; each mixes with 2 of the 3 others), disagreeing along the mixing
    matrix's slowest eigenvector (cos 2πi/n): with a gradient step of lr η on the same quadratic, the consensus
    distance shrinks by exactly (1 − η)·λ₂ per round, λ₂ = (1 + 2cos(2π/n))/3 (the ring's second eigenvalue)."""
    n, eta = 4, RING_LR
    rate = (1 - eta) * (1 + 2 * torch.cos(torch.tensor(2 * torch.pi / n)).item()) / 3
    dists = four[1][0]["ring"]
    assert len(dists) == RING_ROUNDS + 1
    assert dists[0] > 1
    for before, after in zip(dists, dists[1:]):
        assert after == pytest.approx(rate * before, rel=1e-5)


# ---- checkpoints ----------------------------------------------------------------------------------------------

def test_diloco_resumes_bit_exactly_between_outer_steps_and_restarts_under_another_layout(
        four: tuple[Path, list[dict[str, Any]]]) -> None:
    """tp1pp2dp2, H=3 in 3 fragments, each PowerSGD exchange overlapped with the next step: saved at step 2 with
    the second fragment's exchange in flight, resumed in the same layout: each replica's own parameters, inner
    AdamW moments, anchors, outer momentum, the exchange's result and PowerSGD's state after it come back
    (losses and weights bit for bit);
    under tp2pp1dp2 every replica restarts from the saved parameters (a note says so) and trains; the last
    checkpoint (after the final sync) exports to transformers as the run's one model. PowerSGD compresses each
    stage's bucket on its own, yet the tied embedding's two copies (stage 0's embedding, stage 1's head) end
    equal, before and after the resume."""
    results = [r["diloco"] for r in four[1]]
    half = len(results) // 2  # ranks (pp0, dp) then (pp1, dp): the tied copies of one replica pair up
    for first, last in zip(results[:half], results[half:]):
        for key in ("final", "same_final"):
            assert torch.equal(first[key]["tok_embed.weight"], last[key]["head.weight"]), key
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        for name, w in r["final"].items():
            assert torch.equal(r["same_final"][name], w), name
        other = r[str(RESUMED["diloco"][1][0])]["losses"]
        assert all(torch.isfinite(torch.tensor(other))) and other[-1] < r["base"]["losses"][0]
    assert any("holds no replica state" in line for line in results[0]["log"])
    exports_the_final_model(four[0] / "diloco", results, RESUMED["diloco"][0])


def exports_the_final_model(root: Path, results: list[dict[str, Any]], mode: tuple[str, ...]) -> None:
    """The run's last checkpoint (after the final sync) exports to transformers like any other: transformers'
    logits agree with ours and the exported tensors are the replicas' one final model, bit for bit."""
    report = export(Options(step_path(root / "base", STEPS), root / "hf"))
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-5
    final: dict[str, torch.Tensor] = {}
    for r in results:
        final.update(r["final"])
    want = to_hf_state_dict(final, make_cfg(CKPT, 4, extra=list(mode)).model, VOCAB)
    got = load_file(root / "hf" / "model.safetensors")
    assert set(got) <= set(want) and got
    for name, t in got.items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("mode", ["gossip", "ps"])
def test_gossip_and_parameter_server_resume_bit_exactly(four: tuple[Path, list[dict[str, Any]]], mode: str) -> None:
    """tp1pp2dp2, saved at step 2 and resumed in the same layout: gossip's replicas' parameters and AdamW
    moments, the parameter server's shards, AdamW state and version come back: losses and weights bit for bit;
    the last checkpoint (after the final average) exports to transformers as the run's one model."""
    results = [r[mode] for r in four[1]]
    for r in results:
        assert r["same"]["losses"] == r["base"]["losses"][SAVE_AT:]
        for name, w in r["final"].items():
            assert torch.equal(r["same_final"][name], w), name
    exports_the_final_model(four[0] / mode, results, RESUMED[mode][0])
