"""Our pipeline executor against PyTorch's own `torch.distributed.pipelining` schedules.

Both run one training step (forward + backward of every microbatch, no optimizer) of the same
pipeline stages — two copies of each stage built from the same seed, tp=1, untied embeddings
(torch's pipelining does not sync a weight shared between stages) — on the same global batch,
split into the same microbatches, and every parameter gradient and per-microbatch loss must agree.

Loss scaling, the one semantic difference to line up: our last stage returns each
microbatch's mean token cross-entropy and back-propagates it scaled by 1/m (m microbatches), so
the accumulated gradient is Σ_i ∇(CE_i / m). Torch's schedules back-propagate `loss_fn`'s value
unscaled and, with `scale_grads=True` (the default), divide the accumulated gradients by m once
after the step: (Σ_i ∇CE_i) / m. Same mean over the global batch; they differ only in where the
1/m rounds. With m = 4 microbatches (a power of two) both scalings are exact and both backward
every microbatch in the same order, so the gradients must be bit-identical; with another m they
would agree to a few ulps (GRAD_TOL: rtol 1e-5, atol 1e-8 against gradients ~1e-4..1e-1). The
per-microbatch losses (taken before any scaling) agree exactly either way.

The cases run in one launch per pipeline size (2 and 4 ranks, once per session: `launched`), on the fewest
layers that give each of the pp·v parts one (at least 4), with their configs composed before the ranks fork.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from pp_helpers import GLOBAL_BATCH, MICRO, SEQ, TIMEOUT, VOCAB, Case, make_cfg
from test_dp import synthetic_corpus
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from hybrid.model import build_model
from hybrid.parallel import collectives as C
from hybrid.parallel.pp.pipeline import P2P, partition_layers, run_schedule
from hybrid.parallel.pp.schedules import build_schedule
from hybrid.sampler import batch_from

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
MULTI_STAGE = ("interleaved", "zb1p", "zbv")  # torch takes these a list of stages
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-8}


class TorchStage(nn.Module):
    """A stage as torch's pipelining calls it: one positional input; the last stage returns the
    real vocabulary's logits (our module returns the padded vocab-parallel logits without labels)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        return out[..., : self.module.vocab_size] if self.module.post else out


def mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def case_cfg(family: str, pp: int, schedule: str, v: int) -> object:
    """The config of a case: untied embeddings, on the fewest layers that give each part one (at least 4)."""
    case = Case(family, pp=pp, schedule=schedule, v=v, layers=max(4, pp * v))
    return make_cfg(case, pp, extra=["model.tie_embeddings=false"])


def grads_vs_torch(rank: int, world: int, family: str, schedule: str, v: int) -> dict:
    pp = world
    cfg = case_cfg(family, pp, schedule, v)
    m = GLOBAL_BATCH // MICRO
    parts = partition_layers(cfg.model.n_layers, pp * v)
    ours, theirs = [], []
    sched = build_schedule(schedule, pp, m, v)
    for c in range(v):
        s = sched.part(rank, c)
        chunk = build_model(cfg.model, VOCAB, None, layers=parts[s], pre=s == 0, post=s == pp * v - 1,
                            seed=cfg.train.seed)
        ours.append(chunk)
        theirs.append(copy.deepcopy(chunk))
    ids, labels = batch_from(synthetic_corpus(vocab=VOCAB).train, list(range(GLOBAL_BATCH)))
    microbatches = list(zip(ids.chunk(m), labels.chunk(m)))  # what torch's default split along dim 0 makes

    group = dist.new_group(list(range(world)))
    C.name_group(group, "pp")

    def forward_step(chunk: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        module = ours[chunk]
        x_ids, y = microbatches[mb]
        return module(x_ids if module.pre else x, y if module.post else None)

    streams = {s: dist.new_group(list(range(world))) for s in sched.streams}  # as `context.pp_streams` makes
    p2p = P2P(group, (MICRO, SEQ, cfg.model.hidden), torch.float32, torch.device("cpu"), streams)
    our_losses = run_schedule(sched, rank, forward_step, p2p)

    # No input_args/output_args: torch (2.13) infers the stages' shapes at runtime on the first step.
    # `step` takes the whole batch on the first stage and the whole target on the last, and splits
    # both along dim 0 into m microbatches (= `microbatches` above).
    stages = [PipelineStage(TorchStage(t), sched.part(rank, c), pp * v, torch.device("cpu"), group=group)
              for c, t in enumerate(theirs)]
    cls = TORCH_SCHEDULES[schedule]
    runner = cls(stages if schedule in MULTI_STAGE else stages[0], m, loss_fn=mean_cross_entropy)
    their_losses: list[torch.Tensor] = []
    first, last = rank == 0, rank == sched.last_rank  # the V puts the first part and the last on rank 0
    if first or last:
        runner.step(*([ids] if first else []), **({"target": labels, "losses": their_losses} if last else {}))
    else:
        runner.step()

    def grads(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for ch in chunks for n, p in ch.named_parameters()}

    return {"ours": grads(ours), "theirs": grads(theirs), "our_losses": [x.detach() for x in our_losses],
            "their_losses": [x.detach() for x in their_losses]}


CASES = [
    ("gpt", 2, "1f1b", 1), ("llama", 4, "1f1b", 1), ("gpt", 4, "1f1b", 1), ("llama", 2, "1f1b", 1),
    ("gpt", 2, "gpipe", 1), ("llama", 2, "interleaved", 2), ("gpt", 4, "interleaved", 2),
    ("gpt", 2, "zb1p", 1), ("llama", 4, "zb1p", 1), ("llama", 2, "zbv", 2), ("gpt", 4, "zbv", 2),
]


def every_case(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list[dict]:
    """Rank function: `grads_vs_torch` of each (family, schedule, v) in turn."""
    return [grads_vs_torch(rank, world, family, schedule, v) for family, schedule, v in cases]


@functools.cache
def launched(pp: int) -> dict[tuple[str, str, int], list[dict]]:
    """(family, schedule, v) → results by rank of every case on `pp` ranks, from one launch."""
    torch.set_num_threads(1)
    cases = [(family, schedule, v) for family, p, schedule, v in CASES if p == pp]
    for case in cases:
        case_cfg(case[0], pp, *case[1:])
    results = run_ranks(every_case, pp, cases, timeout=TIMEOUT)
    return {case: [r[i] for r in results] for i, case in enumerate(cases)}


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="the reference: torch 2.11's pipelining fails its runtime shape inference over gloo "
                           "('Pair is not connected', 2026-12-02); 2.13 runs it")
@pytest.mark.parametrize("family,pp,schedule,v", CASES)
def test_gradients_equal_torch_pipelining(family: str, pp: int, schedule: str, v: int) -> None:
    results = launched(pp)[(family, schedule, v)]
    m = GLOBAL_BATCH // MICRO
    tol = {"rtol": 0.0, "atol": 0.0} if m & (m - 1) == 0 else GRAD_TOL  # 1/m exact for a power of two
    for rank, r in enumerate(results):
        assert r["ours"].keys() == r["theirs"].keys()
        for name, g in r["theirs"].items():
            assert g.abs().max() > 0, f"rank {rank} {name}: zero gradient"
            torch.testing.assert_close(r["ours"][name], g, **tol, msg=lambda e, n=name, k=rank: f"rank {k} {n}: {e}")
    last = results[build_schedule(schedule, pp, m, v).last_rank]
    assert len(last["our_losses"]) == len(last["their_losses"]) == GLOBAL_BATCH // MICRO
    torch.testing.assert_close(torch.stack(last["our_losses"]), torch.stack(last["their_losses"]), rtol=0, atol=0)
