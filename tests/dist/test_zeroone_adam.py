"""compression=zeroone_adam against 0/1 Adam written here from the paper (Lu, Li, Zhang, De Sa, He 2022).

The reference runs every DP worker in this process, each with its own replica (parameters, momentum, the sum u of
its local steps), per-worker gradients from the same seeded batches as test_onebit_adam.py, and the step kinds
worked out by hand from the paper's rules for the knobs below (`KINDS`):

- refresh (R): the exact mean ḡ (clipped by its norm) updates m and v — v by β₂ˢ for the s steps since the last
  refresh, its bias correction by the last refresh's step (the paper's rule, `var_refresh_every=0`: β₂ once per
  refresh, the correction by the refreshes so far) — and the step uses the fresh variance, floored at m̂² once a
  step before sent the momentum as signs;
- onebit (O): each worker's momentum β₁m + (1 − β₁)gᵢ (gᵢ clipped by its own norm) averaged through the
  compressed all-reduce with worker and server residuals (test_onebit_adam.py's), the step with the stale
  variance floored at m̂²;
- local (L), after the freeze: each worker steps alone, 1-bit Adam's step on its own momentum (floored at its
  m̂²), and sums its steps in u (in units of d₀ = √v̂ + ε, the frozen variance's);
- sync (S): a local step, then u's compressed mean ū: m = ū/S·(1 − β₁ᵗ), p = (p + u/d₀) − ū/d with d floored
  at the synced m̂², u = 0.

hybrid's ranks run `GradSync` + `build_optimizer`; every rank's parameters must agree with its worker's after
every step at dp=2 and dp=4 (and under the paper's rule at dp=2), the counted DP bytes of each step must be its
kind's formula, a resume in place from one replica's saved tensors and this rank's blob must continue bit for bit,
and a resume at another DP size (the blob dropped) must follow the reference restarted from rank 0's replica;
with the vectors kept exact (`compression.exact_params`) their parameters must stay alike on every replica
through the local steps.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from test_onebit_adam import BLOCK, BUCKET_MB, LR, OPTIM, TIMEOUT, assert_tracks, batch, clipped, net
from test_onebit_adam import Reference as OneBitReference
from torch import nn
from torch.func import functional_call, grad

from hybrid.checkpoint.state import init_optimizer_state
from hybrid.compression import CompressionError, codecs
from hybrid.compression.hooks import make_hook
from hybrid.compression.schedule import exact_param_ids
from hybrid.compression.zeroone_adam import ZeroOneSchedule, check_knobs
from hybrid.config import CompressionConfig
from hybrid.optim import ZeroOneAdam, build_optimizer
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.data import GradSync

KNOBS = {"var_freeze_step": 7, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
FREEZE, STEPS = 7, 14
# κ = 2: refreshes at 1, 2, 3, 5, 7 (gaps 1, 1, 2, 2, 4, …); after the freeze at 7 the interval at the s-th step is
# min(4, 2^⌊(s − 1)/2⌋): 1, 1, 2, 2, 4, 4, 4 — syncs at s = 1, 2, 4 and the run's last step (14)
KINDS = "RRRORORSSLSLLS"
PAPER = {"var_refresh_every": 0}  # the paper's refreshes: one β₂ each, uncapped gaps
SPLIT = 12  # the checkpoint's step: after a local step, mid-interval


def compression(**more: object) -> CompressionConfig:
    return CompressionConfig(method="zeroone_adam", block_size=BLOCK, **KNOBS, **more)


# ---- hybrid's ranks --------------------------------------------------------------------------------

def build(world: int, model: nn.Module, paper: bool = False) -> tuple[GradSync, ZeroOneAdam]:
    ctx = ParallelContext.build(Layout.create(world, dp=world))
    hook, state = make_hook(compression(**PAPER) if paper else compression(), ctx.dp_group)
    sync = GradSync(list(model.parameters()), ctx.dp_group, hook, state, BUCKET_MB)
    return sync, build_optimizer(model, OPTIM, LR, ctx, sync, onebit=state, steps=STEPS)


def train(rank: int, model: nn.Module, sync: GradSync, opt: ZeroOneAdam, steps: range) -> tuple[list, list[int]]:
    """Each step's parameters, and the DP bytes it counted."""
    out, sent = [], []
    for t in steps:
        C.COUNTER.reset()
        x, y = batch(rank, t)
        F.mse_loss(model(x), y).backward()
        sync.finish()
        opt.step(LR)
        sync.zero_grad()
        sent.append(C.COUNTER.group_bytes(C.group_name(opt.ctx.dp_group)))
        out.append([p.detach().clone() for p in model.parameters()])
    return out, sent


def saved(model: nn.Module, opt: ZeroOneAdam) -> tuple[dict, bytes]:
    """What a checkpoint holds of this rank: its parameters and AdamW state (the DCP part), its hook blob."""
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    buf = io.BytesIO()
    torch.save(opt.comp.state_dict(), buf)
    return {"params": [p.detach().clone() for p in model.parameters()], "optim": state}, buf.getvalue()


def resume(world: int, ckpt: dict, blob: bytes | None, paper: bool = False) -> tuple[nn.Module, GradSync,
                                                                                   ZeroOneAdam]:
    """A fresh model, sync and optimizer filled from `ckpt` as the checkpoint loader fills them: the tensors in
    place, `loaded()`, then the hook blob (same layout) or the step count alone (another layout)."""
    model = net()
    sync, opt = build(world, model, paper)
    init_optimizer_state(opt)
    with torch.no_grad():
        for p, value, state in zip(model.parameters(), ckpt["params"], ckpt["optim"]):
            p.copy_(value)
            for k, v in state.items():
                opt.state[p][k].copy_(v)
    opt.loaded()
    if blob is not None:
        opt.comp.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    else:
        opt.comp.iteration = int(ckpt["optim"][0]["step"])
    return model, sync, opt


def worker(rank: int, world: int, paper: bool = False) -> dict:
    model = net()
    sync, opt = build(world, model, paper)
    first, sent = train(rank, model, sync, opt, range(SPLIT))
    ckpt, blob = saved(model, opt)
    rest, more = train(rank, model, sync, opt, range(SPLIT, STEPS))
    box = [ckpt if rank == 0 else None]  # the DCP part holds one replica's tensors (here rank 0's) ...
    dist.broadcast_object_list(box, src=0)
    model2, sync2, opt2 = resume(world, box[0], blob, paper)  # ... and this rank's blob the rest of its own
    resumed, _ = train(rank, model2, sync2, opt2, range(SPLIT, STEPS))
    return {"steps": first + rest, "bytes": sent + more, "resumed": resumed, "ckpt": ckpt,
            "sizes": [b.numel() for b in sync.buckets], "v": [opt.state[p]["exp_avg_sq"] for p in model.parameters()]}


def exact_worker(rank: int, world: int) -> list:
    """The same run with the vectors (biases) kept exact: their buckets all-reduced every step."""
    model = net()
    ctx = ParallelContext.build(Layout.create(world, dp=world))
    hook, state = make_hook(compression(exact_params=["vectors"]), ctx.dp_group)
    state.exact_params = exact_param_ids(model.named_parameters(), ["vectors"])
    sync = GradSync(list(model.parameters()), ctx.dp_group, hook, state, BUCKET_MB, apart=state.exact_params)
    return train(rank, model, sync, build_optimizer(model, OPTIM, LR, ctx, sync, onebit=state, steps=STEPS),
                 range(STEPS))[0]


def resumed_worker(rank: int, world: int, ckpt: dict) -> list:
    model, sync, opt = resume(world, ckpt, None)
    return train(rank, model, sync, opt, range(SPLIT, STEPS))[0]


# ---- the reference ----------------------------------------------------------------------------------

class Reference(OneBitReference):
    """0/1 Adam over `n` workers; the compressed all-reduce and its residuals are 1-bit Adam's reference's."""

    def __init__(self, n: int, model: nn.Module, paper: bool = False) -> None:
        super().__init__(n, model)
        self.paper = paper
        zeros = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.p = [dict(self.params) for _ in range(n)]  # each worker's replica
        self.mr = [dict(zeros) for _ in range(n)]  # each worker's momentum
        self.u = [dict(zeros) for _ in range(n)]
        self.v, self.h, self.sums = dict(zeros), 0, {True: 0.0, False: 0.0}  # S per decay group

    def load(self, ckpt: dict) -> None:
        """Every worker restarts from one replica's parameters and momentum: u = 0, S = 0, residuals 0."""
        names = list(self.params)
        self.p = [{k: p.clone() for k, p in zip(names, ckpt["params"])} for _ in range(self.n)]
        self.mr = [{k: s["exp_avg"].clone() for k, s in zip(names, ckpt["optim"])} for _ in range(self.n)]
        self.v = {k: s["exp_avg_sq"].clone() for k, s in zip(names, ckpt["optim"])}
        self.t = int(ckpt["optim"][0]["step"])
        self.h = self.horizon(self.t)

    def horizon(self, t: int) -> int:
        """v's bias-correction exponent after step t: the last refresh's step (the refreshes' count, the paper's)."""
        done = KINDS[:t]
        return done.count("R") if self.paper else done.rfind("R") + 1

    def grads(self, rank: int, t: int) -> dict:
        x, y = batch(rank, t)
        return grad(lambda ps: F.mse_loss(functional_call(self.model, ps, (x,)), y))(self.p[rank])

    def step(self, t: int) -> list[list[torch.Tensor]]:
        """Step t (0-based batch index) on every worker; each worker's parameters after it."""
        self.t += 1
        kind = KINDS[self.t - 1]
        if kind == "R":
            self.refresh(t)
        elif kind == "O":
            self.onebit(t)
        else:
            self.local(t, sync=kind == "S")
        return [list(p.values()) for p in self.p]

    def refresh(self, t: int) -> None:
        b1, b2 = OPTIM.beta1, OPTIM.beta2
        gs = [self.grads(r, t) for r in range(self.n)]
        g = clipped({k: sum(x[k] for x in gs) / self.n for k in self.params})
        m = {k: b1 * self.mr[0][k] + (1 - b1) * g[k] for k in g}
        decay = b2 ** (1 if self.paper else self.t - self.h)  # the steps since the last refresh
        self.v = {k: decay * self.v[k] + (1 - decay) * g[k] ** 2 for k in g}
        self.h = self.horizon(self.t)
        self.mr = [dict(m) for _ in range(self.n)]
        signed = "O" in KINDS[: self.t - 1]
        self.apply(self.floored(m, self.t) if signed else
                   {k: (self.v[k] / (1 - b2 ** self.h)).sqrt() + OPTIM.eps for k in g})

    def onebit(self, t: int) -> None:
        b1 = OPTIM.beta1
        local = [clipped(self.grads(r, t)) for r in range(self.n)]
        m = {}
        for i, names in enumerate(self.buffers):
            moms = [torch.cat([(b1 * self.mr[0][k] + (1 - b1) * g[k]).reshape(-1) for k in names]) for g in local]
            m |= self.split(names, self.exchange(i, moms) if self.n > 1 else moms[0])
        self.mr = [dict(m) for _ in range(self.n)]
        self.apply(self.floored(m, self.t))

    def local(self, t: int, sync: bool) -> None:
        b1, b2 = OPTIM.beta1, OPTIM.beta2
        if self.t == FREEZE + 1:  # the exchange turns from the momentum to u
            self.worker_err.clear()
            self.server_err.clear()
        d0 = {k: (v / (1 - b2 ** self.h)).sqrt() + OPTIM.eps for k, v in self.v.items()}  # u's unit
        for r in range(self.n):
            g = clipped(self.grads(r, t))
            self.mr[r] = {k: b1 * self.mr[r][k] + (1 - b1) * g[k] for k in g}
            d = self.floored(self.mr[r], self.t)
            for k, p in self.p[r].items():
                decay, m_hat = 1 - LR * self.wd(p), self.mr[r][k] / (1 - b1 ** self.t)
                self.p[r][k] = p * decay - LR * m_hat / d[k]
                self.u[r][k] = self.u[r][k] * decay + LR * m_hat * d0[k] / d[k]
        self.sums = {kind: s * (1 - LR * (OPTIM.weight_decay if kind else 0.0)) + LR for kind, s in self.sums.items()}
        if sync:
            self.sync(d0)

    def sync(self, d0: dict) -> None:
        """ū lands: m̂ = ū/S, p = (p + u/d₀) − ū/√max(v̂, m̂²) + ε on every worker; u, S restart."""
        bias = 1 - OPTIM.beta1 ** self.t
        for i, names in enumerate(self.buffers):
            sums = [torch.cat([u[k].reshape(-1) for k in names]) for u in self.u]
            avg = self.split(names, self.exchange(i, sums) if self.n > 1 else sums[0])
            m = {k: avg[k] / self.sums[avg[k].ndim >= 2] * bias for k in names}
            d = self.floored(m, self.t)
            for r in range(self.n):
                for k in names:
                    self.p[r][k] = self.p[r][k] + self.u[r][k] / d0[k] - avg[k] / d[k]
                    self.mr[r][k] = m[k]
        self.u = [{k: torch.zeros_like(x) for k, x in u.items()} for u in self.u]
        self.sums = {True: 0.0, False: 0.0}

    def apply(self, d: dict) -> None:
        """The synced step: every worker's p ← p·(1 − lr·wd) − lr·m̂/d with the (common) momentum."""
        for r in range(self.n):
            for k, p in self.p[r].items():
                m_hat = self.mr[r][k] / (1 - OPTIM.beta1 ** self.t)
                self.p[r][k] = p * (1 - LR * self.wd(p)) - LR * m_hat / d[k]

    def floored(self, m: dict, t: int) -> dict:
        """√max(v̂, m̂²) + ε, m̂ bias-corrected as after step t, v̂ as after the last refresh."""
        b1, b2 = OPTIM.beta1, OPTIM.beta2
        return {k: torch.maximum(self.v[k] / (1 - b2 ** self.h), (m[k] / (1 - b1 ** t)) ** 2).sqrt() + OPTIM.eps
                for k in m}

    def split(self, names: list[str], flat: torch.Tensor) -> dict:
        out, offset = {}, 0
        for k in names:
            n = self.params[k].numel()
            out[k] = flat[offset: offset + n].view_as(self.params[k])
            offset += n
        return out

    @staticmethod
    def wd(p: torch.Tensor) -> float:
        return OPTIM.weight_decay if p.ndim >= 2 else 0.0


def expected_bytes(kind: str, sizes: list[int], n: int) -> int:
    """The DP payload a step of `kind` counts: the fp32 all-reduce, the sign exchange, or nothing."""
    if kind == "R":
        return sum(4 * s for s in sizes)
    sign = codecs.SignCodec(BLOCK)
    return sum(codecs.payload_bytes(sign, s, n) for s in sizes) if kind in "OS" else 0


# ---- the tests ----------------------------------------------------------------------------------------

def test_the_schedule_is_the_papers_with_its_gaps_capped_and_sizes_itself_from_the_run() -> None:
    letters = {"refresh": "R", "onebit": "O", "local": "L", "sync": "S"}
    for more in ({}, PAPER):  # κ = 2's gaps stay under the cap (10 at β₂ = 0.95): the same steps
        plan = ZeroOneSchedule.of(compression(**more)).sized(STEPS, OPTIM.beta2)
        assert "".join(letters[plan.kind(t)] for t in range(1, STEPS + 1)) == KINDS
    auto = ZeroOneSchedule.of(CompressionConfig(method="zeroone_adam"))
    short, long = auto.sized(200, 0.95), auto.sized(5000, 0.95)
    assert (short.freeze, short.scaler, short.local_scaler, short.cap) == (100, 4, 20, 10)  # 20 refreshes ≤ 10%
    assert short.at == (1, 2, 3, 4, 5, 7, 9, 11, 13, 17, 21, 25, 29, 37, 45, 53, 61, 71, 81, 91)  # gaps ≤ 10
    assert (short.gap(71), short.horizon(75), short.horizon(200), short.signed(5), short.signed(7)) == (10, 71, 91,
                                                                                                      False, True)
    paper = ZeroOneSchedule.of(CompressionConfig(method="zeroone_adam", **PAPER)).sized(200, 0.95)
    assert paper.at[-3:] == (61, 77, 93) and (paper.gap(77), paper.horizon(80)) == (1, 18)  # one β₂ per refresh
    assert (long.freeze, long.scaler, long.cap) == (2500, 16, 10)  # the paper's κ once the run is long enough
    assert auto.sized(5000, 0.999).cap == 500  # the paper's β₂: its gaps (up to 2^⌊j/16⌋) stay under the cap
    assert [short.interval(t) for t in (101, 120, 121, 181, 200)] == [1, 1, 2, 16, 16]
    warm = ZeroOneSchedule.of(compression(warmup_steps=9)).sized(STEPS, OPTIM.beta2)
    assert warm.refreshes(STEPS) == 9  # 1..9: the freeze moves


@pytest.mark.parametrize("knob,value,needle", [
    ("var_freeze_step", -1, "compression.var_freeze_step must be >= 0"),
    ("var_update_scaler", -1, "compression.var_update_scaler must be >= 0"),
    ("local_step_scaler", -3, "compression.local_step_scaler must be >= 0"),
    ("local_step_clipper", 0, "compression.local_step_clipper must be >= 1"),
    ("schedule", "auto", "compression=zeroone_adam refreshes Adam's variance on its own schedule"),
])
def test_bad_knobs_are_one_line(knob: str, value: object, needle: str) -> None:
    with pytest.raises(CompressionError, match=needle):
        check_knobs(CompressionConfig(method="zeroone_adam", **{knob: value}))


@pytest.fixture(scope="module")
def runs() -> dict[int, list]:
    return {world: run_ranks(worker, world, timeout=TIMEOUT) for world in (2, 4)}


@pytest.fixture(scope="module")
def paper_runs() -> dict[int, list]:
    return {2: run_ranks(worker, 2, True, timeout=TIMEOUT)}


@pytest.mark.parametrize("world,paper", [(2, False), (4, False), (2, True)])
def test_zeroone_adam_matches_the_reference_step_by_step_with_its_bytes(world: int, paper: bool, runs: dict,
                                                                        paper_runs: dict) -> None:
    ranks = (paper_runs if paper else runs)[world]
    ref = Reference(world, net(), paper)
    expected = [ref.step(t) for t in range(STEPS)]
    for rank, r in enumerate(ranks):
        assert_tracks(r["steps"], [e[rank] for e in expected], f"dp={world} rank {rank}")
        assert r["bytes"] == [expected_bytes(k, r["sizes"], world) for k in KINDS], f"dp={world} rank {rank}"
        for a, b in zip(r["resumed"], r["steps"][SPLIT:]):  # resumed in place: bit for bit
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    for t, kind in enumerate(KINDS):  # the replicas agree after every step but a local one
        agree = all(torch.equal(x, y) for r in ranks[1:] for x, y in zip(r["steps"][t], ranks[0]["steps"][t]))
        assert agree == (kind != "L"), (world, t + 1, kind)


@pytest.mark.parametrize("world,others", [(2, (4, 1)), (4, (2,))])
def test_a_resume_at_another_dp_size_restarts_the_interval_from_one_replica(world: int, others: tuple,
                                                                          runs: dict) -> None:
    ckpt = runs[world][0]["ckpt"]  # saved mid-interval: rank 0's replica, the blob dropped
    for other in others:
        after = run_ranks(resumed_worker, other, ckpt, timeout=TIMEOUT)
        ref = Reference(other, net())
        ref.load(ckpt)
        expected = [ref.step(t) for t in range(SPLIT, STEPS)]
        for rank, r in enumerate(after):
            assert_tracks(r, [e[rank] for e in expected], f"dp={world} → dp={other} rank {rank}")


def test_the_variance_freezes_after_its_last_refresh(runs: dict) -> None:
    saved_v = [s["exp_avg_sq"] for s in runs[2][0]["ckpt"]["optim"]]  # at step 12, after the freeze at 7
    for r in runs[2]:
        assert all(torch.equal(a, b) for a, b in zip(r["v"], saved_v))


def test_buckets_kept_exact_stay_alike_on_every_replica() -> None:
    """A kept-exact bucket's gradient is the DP mean everywhere; clipped by the replicas' mean norm (not each
    replica's own) its parameters stay bit-identical through the local steps too."""
    ranks = run_ranks(exact_worker, 2, timeout=TIMEOUT)
    for t, kind in enumerate(KINDS):
        same = [torch.equal(a, b) for a, b in zip(ranks[0][t], ranks[1][t])]
        assert same == [True] * len(same) if kind != "L" else same == [p.ndim < 2 for p in net().parameters()]
