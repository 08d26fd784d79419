"""compression=onebit_adam against 1-bit Adam written here from the paper (Tang et al. 2021, Algorithm 1).

The reference runs every DP worker in this process: per-worker gradients from the same seeded batches,
AdamW on their mean for the warm-up, then each worker's momentum m ← β₁m + (1 − β₁)gᵢ compressed with
worker error feedback (sign · mean|x| per block of each chunk), averaged per chunk by its owner, compressed
again with server error feedback, and the step taken with the variance of the last refresh — every REFRESH-th
step after the warm-up, v ← β₂ᵏ·v + (1 − β₂ᵏ)·ḡ² from the workers' mean clipped gradient — or, with refreshes off
(`compression.var_refresh_every=0`), frozen at the warm-up's last value (floored at the squared momentum either way).
hybrid's ranks run `GradSync` + `build_optimizer` over the same model; the parameters must agree after
every step, at dp=2 and dp=4, after a resume from the saved state (in place, as the checkpoint loads it),
and after a resume at another DP size (momentum and variance kept, residuals restarted at zero).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (AdamW imports it lazily: once here, not in every forked rank)
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from torch.func import functional_call, grad

from hybrid.checkpoint.state import init_optimizer_state
from hybrid.compression.hooks import make_hook
from hybrid.config import CompressionConfig, OptimConfig
from hybrid.optim import OneBitAdam, build_optimizer
from hybrid.parallel import collectives as C
from hybrid.parallel.context import Layout, ParallelContext
from hybrid.parallel.dp.buckets import assign_buckets
from hybrid.parallel.dp.data import GradSync

BLOCK, WARMUP, STEPS, LR, BUCKET_MB = 16, 3, 8, 3e-3, 0.003
REFRESH = 2  # the variance refreshed at steps 5 and 7 (the checkpoint's step, SPLIT, is a refresh)
OPTIM = OptimConfig(weight_decay=0.1, grad_clip=0.5)
TIMEOUT = 120


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 20), nn.Tanh(), nn.Linear(20, 5))


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(6, 12, generator=gen), torch.randn(6, 5, generator=gen)


def compression(refresh: int = REFRESH) -> CompressionConfig:
    return CompressionConfig(method="onebit_adam", block_size=BLOCK, warmup_steps=WARMUP, var_refresh_every=refresh)


# ---- hybrid's ranks --------------------------------------------------------------------------------

def build(world: int, model: nn.Module, refresh: int = REFRESH) -> tuple[GradSync, OneBitAdam]:
    ctx = ParallelContext.build(Layout.create(world, dp=world))
    hook, state = make_hook(compression(refresh), ctx.dp_group)
    sync = GradSync(list(model.parameters()), ctx.dp_group, hook, state, BUCKET_MB)
    return sync, build_optimizer(model, OPTIM, LR, ctx, sync, onebit=state)


def train(rank: int, model: nn.Module, sync: GradSync, opt: OneBitAdam, steps: range,
          reduced: list | None = None) -> list[list[torch.Tensor]]:
    """Train `steps`; `reduced` gets each step's all-reduced DP bytes (the counter's payload)."""
    out = []
    for t in steps:
        C.COUNTER.reset()
        x, y = batch(rank, t)
        F.mse_loss(model(x), y).backward()
        sync.finish()
        opt.step(LR)
        sync.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
        if reduced is not None:
            reduced.append(C.COUNTER.bytes.get(("dp", "all_reduce"), 0))
    return out


def saved(model: nn.Module, opt: OneBitAdam) -> dict:
    """What a checkpoint holds of this rank: parameters, AdamW's per-parameter state, the hook's blob."""
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    buf = io.BytesIO()
    torch.save(opt.comp.state_dict(), buf)
    return {"params": [p.detach().clone() for p in model.parameters()], "optim": state, "hook": buf.getvalue()}


def resume(world: int, ckpt: dict, same_layout: bool, refresh: int) -> tuple[nn.Module, GradSync, OneBitAdam]:
    """A fresh model, sync and optimizer filled from `ckpt` in place (as the checkpoint loader fills them)."""
    model = net()
    sync, opt = build(world, model, refresh)
    init_optimizer_state(opt)
    with torch.no_grad():
        for p, value, state in zip(model.parameters(), ckpt["params"], ckpt["optim"]):
            p.copy_(value)
            for k, v in state.items():
                opt.state[p][k].copy_(v)
    if same_layout:
        opt.comp.load_state_dict(torch.load(io.BytesIO(ckpt["hook"]), weights_only=True))
    else:
        opt.comp.iteration = int(ckpt["optim"][0]["step"])
    return model, sync, opt


def worker(rank: int, world: int, split: int, refresh: int = REFRESH) -> dict:
    model = net()
    sync, opt = build(world, model, refresh)
    reduced: list[int] = []
    first = train(rank, model, sync, opt, range(split), reduced)
    ckpt = saved(model, opt)
    rest = train(rank, model, sync, opt, range(split, STEPS), reduced)
    end = {k: [opt.state[p][k].clone() for p in model.parameters()] for k in ("exp_avg", "exp_avg_sq")}
    model2, sync2, opt2 = resume(world, ckpt, True, refresh)
    resumed = train(rank, model2, sync2, opt2, range(split, STEPS))
    return {"steps": first + rest, "resumed": resumed, "ckpt": ckpt, "end": end, "reduced": reduced}


def resumed_worker(rank: int, world: int, ckpt: dict, split: int, refresh: int = REFRESH) -> list:
    model, sync, opt = resume(world, ckpt, False, refresh)
    return train(rank, model, sync, opt, range(split, STEPS))


# ---- the reference ----------------------------------------------------------------------------------

def quantise(x: torch.Tensor) -> torch.Tensor:
    """1-bit compression of a chunk: the sign of each element times its block's mean magnitude."""
    blocks = x.view(-1, BLOCK)
    return (torch.where(blocks >= 0, 1.0, -1.0) * blocks.abs().mean(dim=1, keepdim=True)).view(-1)


def clipped(g: dict) -> dict:
    norm = float(torch.cat([v.reshape(-1) for v in g.values()]).norm())
    return {k: v * min(1.0, OPTIM.grad_clip / (norm + 1e-6)) for k, v in g.items()}


class Reference:
    """1-bit Adam over `n` workers, the momentum exchanged per buffer (the gradient buckets' layout)."""

    def __init__(self, n: int, model: nn.Module, refresh: int = REFRESH) -> None:
        self.n, self.model, self.every = n, model, refresh
        self.refreshed = WARMUP  # the step of the variance in use
        self.params = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.m = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.t = 0
        by_id = {id(p): k for k, p in model.named_parameters()}
        self.buffers = [[by_id[id(p)] for p in b] for b in assign_buckets(list(model.parameters()),
                                                                           int(BUCKET_MB * 2**20))]
        self.worker_err: dict = {}
        self.server_err: dict = {}

    def load(self, ckpt: dict) -> None:
        """Continue from a checkpoint: parameters, momentum, variance, step; residuals restart at 0."""
        for k, p, s in zip(self.params, ckpt["params"], ckpt["optim"]):
            self.params[k], self.m[k], self.v[k] = p.clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()
        self.t = int(ckpt["optim"][0]["step"])
        self.refreshed = WARMUP + (self.t - WARMUP) // self.every * self.every if self.every else WARMUP

    def grads(self, rank: int, t: int) -> dict:
        x, y = batch(rank, t)
        return grad(lambda ps: F.mse_loss(functional_call(self.model, ps, (x,)), y))(self.params)

    def step(self, t: int) -> list[torch.Tensor]:
        b1, b2 = OPTIM.beta1, OPTIM.beta2
        self.t += 1
        if self.t <= WARMUP:
            gs = [self.grads(r, t) for r in range(self.n)]
            mean = {k: sum(g[k] for g in gs) / self.n for k in self.params}
            g = clipped(mean)  # the DP mean, clipped by its norm
            for k in self.params:
                self.m[k] = b1 * self.m[k] + (1 - b1) * g[k]
                self.v[k] = b2 * self.v[k] + (1 - b2) * g[k] ** 2
            bc2 = 1 - b2 ** self.t
        else:
            local = [clipped(self.grads(r, t)) for r in range(self.n)]  # each worker clips its own
            for i, names in enumerate(self.buffers):
                moms = [torch.cat([(b1 * self.m[k] + (1 - b1) * g[k]).reshape(-1) for k in names]) for g in local]
                avg = self.exchange(i, moms) if self.n > 1 else moms[0]  # one worker: nothing to send
                offset = 0
                for k in names:
                    self.m[k] = avg[offset: offset + self.m[k].numel()].view_as(self.m[k])
                    offset += self.m[k].numel()
            if self.every and (self.t - WARMUP) % self.every == 0:  # the exact mean of the clipped gradients
                decay = b2 ** self.every
                for k in self.params:
                    mean = sum(g[k] for g in local) / self.n
                    self.v[k] = decay * self.v[k] + (1 - decay) * mean ** 2
                self.refreshed = self.t
            bc2 = 1 - b2 ** self.refreshed
        for k, p in self.params.items():
            decay = OPTIM.weight_decay if p.ndim >= 2 else 0.0
            m_hat, v_hat = self.m[k] / (1 - b1 ** self.t), self.v[k] / bc2
            if self.t > WARMUP:  # refreshed or frozen: floored at the squared momentum
                v_hat = torch.maximum(v_hat, m_hat ** 2)
            self.params[k] = p * (1 - LR * decay) - LR * m_hat / (v_hat.sqrt() + OPTIM.eps)
        return list(self.params.values())

    def exchange(self, i: int, moms: list[torch.Tensor]) -> torch.Tensor:
        """The compressed DP mean with worker and server error feedback, chunk j owned by worker j."""
        numel, n = moms[0].numel(), self.n
        length = math.ceil(math.ceil(numel / n) / math.lcm(BLOCK, 8)) * math.lcm(BLOCK, 8)
        sent = []
        for r, m in enumerate(moms):
            x = torch.zeros(n * length)
            x[:numel] = m
            x += self.worker_err.get((i, r), torch.zeros(n * length))
            q = torch.cat([quantise(c) for c in x.view(n, length)])
            err = x - q
            err[numel:] = 0
            self.worker_err[(i, r)] = err
            sent.append(q.view(n, length))
        out = []
        for j in range(n):
            avg = sum(s[j] for s in sent) / n
            avg[max(0, min(length, numel - j * length)):] = 0
            avg = avg + self.server_err.get((i, j), torch.zeros(length))
            q = quantise(avg)
            err = avg - q
            err[max(0, min(length, numel - j * length)):] = 0
            self.server_err[(i, j)] = err
            out.append(q)
        return torch.cat(out)[:numel]


def assert_tracks(ours: list, ref: list, what: str) -> None:
    for t, (a, b) in enumerate(zip(ours, ref)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{what}: step {t + 1}")


SPLIT = WARMUP + 2  # the checkpoint's step: inside the compression stage


@pytest.fixture(scope="module")
def dp2() -> list:
    return run_ranks(worker, 2, SPLIT, timeout=TIMEOUT)


@pytest.mark.parametrize("world,refresh", [(2, REFRESH), (4, REFRESH), (2, 0)], ids=["dp2", "dp4", "dp2-frozen"])
def test_onebit_adam_matches_the_reference_step_by_step_and_across_resumes(world: int, refresh: int, dp2: list) -> None:
    split = SPLIT
    runs = dp2 if (world, refresh) == (2, REFRESH) else run_ranks(worker, world, split, refresh, timeout=TIMEOUT)
    ref = Reference(world, net(), refresh)
    expected = [ref.step(t) for t in range(STEPS)]
    for rank, r in enumerate(runs):
        assert_tracks(r["steps"], expected, f"dp={world} rank {rank}")
        for a, b in zip(r["resumed"], r["steps"][split:]):  # resumed in place: bit for bit
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(expected) == STEPS and not torch.equal(expected[WARMUP][0], expected[WARMUP - 1][0])

    for other in {2: (4, 1), 4: (2,)}[world] if refresh else ():  # the checkpoint, resumed at other DP sizes
        after = run_ranks(resumed_worker, other, runs[0]["ckpt"], split, timeout=TIMEOUT)
        ref2 = Reference(other, net())
        ref2.load(runs[0]["ckpt"])
        expected2 = [ref2.step(t) for t in range(split, STEPS)]
        for rank, r in enumerate(after):
            assert_tracks(r, expected2, f"dp={world} → dp={other} rank {rank}")


def test_the_variance_moves_at_refreshes_only_and_both_moments_are_identical_across_dp(dp2: list) -> None:
    saved = [s["exp_avg_sq"] for s in dp2[0]["ckpt"]["optim"]]  # at step 5, a refresh; the next is step 7
    for r in dp2:
        assert all(torch.equal(a, b) for a, b in zip(r["end"]["exp_avg_sq"], dp2[0]["end"]["exp_avg_sq"]))
        assert all(torch.equal(a, b) for a, b in zip(r["end"]["exp_avg"], dp2[0]["end"]["exp_avg"]))
    assert not any(torch.equal(a, b) for a, b in zip(dp2[0]["end"]["exp_avg_sq"], saved))
    assert not all(torch.equal(s["exp_avg"], m) for s, m in zip(dp2[0]["ckpt"]["optim"], dp2[0]["end"]["exp_avg"]))


def test_each_refresh_all_reduces_the_gradient_once_in_fp32_and_its_interval_follows_beta2(dp2: list) -> None:
    """The exact stage and every REFRESH-th step after it all-reduce each bucket's fp32 gradient (counted as DP
    traffic), the steps between none (their momentum goes as signs); unset, k is half of 1/(1 − β₂)."""
    from hybrid.compression.onebit_adam import refresh_every

    numel = sum(p.numel() for p in net().parameters())
    refreshes = [t <= WARMUP or (t - WARMUP) % REFRESH == 0 for t in range(1, STEPS + 1)]
    assert dp2[0]["reduced"] == [4 * numel if r else 0 for r in refreshes]
    assert [refresh_every(None, b) for b in (0.95, 0.99, 0.999)] == [10, 50, 500]
    assert refresh_every(0, 0.95) == 0 and refresh_every(3, 0.95) == 3


def exact_worker(rank: int, world: int) -> list[list[torch.Tensor]]:
    """1-bit Adam with the vectors (biases) kept exact (`compression.exact_params`): their buckets all-reduced at
    every step, the rest's momentum exchanged as signs; the variance refreshed (the kept-exact buckets' from their
    gradient as it is, the mean already)."""
    from hybrid.compression.schedule import exact_param_ids

    model = net()
    ctx = ParallelContext.build(Layout.create(world, dp=world))
    hook, state = make_hook(CompressionConfig(method="onebit_adam", block_size=BLOCK, warmup_steps=WARMUP,
                                              exact_params=["vectors"], var_refresh_every=REFRESH), ctx.dp_group)
    state.exact_params = exact_param_ids(model.named_parameters(), ["vectors"])
    sync = GradSync(list(model.parameters()), ctx.dp_group, hook, state, BUCKET_MB, apart=state.exact_params)
    return train(rank, model, sync, build_optimizer(model, OPTIM, LR, ctx, sync, onebit=state), range(STEPS))


def test_buckets_kept_exact_stay_alike_on_every_replica() -> None:
    """A kept-exact bucket's gradient is the DP mean on every replica; clipped by the replicas' mean norm (not each
    replica's own, which differ after the warm-up) its parameters, like the rest, stay bit-identical."""
    ranks = run_ranks(exact_worker, 2, timeout=TIMEOUT)
    for a, b in zip(ranks[0], ranks[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
