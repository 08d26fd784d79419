"""The block codecs on scaled values (`hybrid.compression.scaling`), on 2 gloo ranks, against a reference written
from its description: the scale computed from the all-gathered statistics, the plain two-phase exchange of
`codecs.py` on the divided bucket (its residuals kept in the scaled units and re-read at each step's scale, the
other way of keeping them consistent), multiplied back. Bit for bit over several steps with error feedback (a
row-parallel weight laid out by columns in the bucket); the counted bytes are the codec's and the statistics'
formulas; and on a gradient whose rows and columns differ by orders of magnitude the error against each element's
magnitude falls well under half."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from hybrid.compression import codecs, scaling
from hybrid.compression.hooks import make_hook
from hybrid.compression.layout import transpose_spans
from hybrid.config import CompressionConfig
from hybrid.parallel import collectives as C
from hybrid.parallel.dp.buckets import GradBucket
from hybrid.parallel.params import ParamInfo

TIMEOUT, STEPS, BLOCK = 120, 4, 32
SHAPES = [(24, 40), (40,), (6, 4, 5)]  # a row-parallel weight (flagged), a bias, a 3-D gradient
SPANS = [(0, 24, 40)]


def bucket_of(buf: torch.Tensor) -> GradBucket:
    params = [nn.Parameter(torch.empty(s)) for s in SHAPES]
    params[0].hybrid = ParamInfo(column_blocks=True)  # what `RowParallelLinear` sets
    return GradBucket(0, buf, params, True)


def gradient(rank: int, step: int) -> torch.Tensor:
    """This rank's bucket: each matrix's rows and columns scaled 10^±1 (shared by the ranks), noise per rank."""
    out = []
    for s in SHAPES:
        shared = torch.Generator().manual_seed(step)
        g = torch.randn(s, generator=torch.Generator().manual_seed(1000 * step + rank))
        if len(s) >= 2:
            rows, cols = s[0], g.numel() // s[0]
            g = g.reshape(rows, cols) * torch.outer(10 ** (torch.rand(rows, generator=shared) * 2 - 1),
                                                    10 ** (torch.rand(cols, generator=shared) * 2 - 1))
        out.append(g.reshape(-1))
    return torch.cat(out)


def reference_scale(buf: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """√(Rᵢ·Cⱼ / mean R) + 10⁻³ of its mean per matrix, R and C the ranks' mean of its rows' and columns' mean
    squares (all-gathered here), 1 elsewhere."""
    scale, at = torch.ones_like(buf), 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        if len(s) >= 2:
            sq = buf[at: at + n].view(s[0], -1).pow(2)
            mine = torch.cat([sq.mean(1), sq.mean(0)])
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, mine, group=group)
            stats = (every[0] + every[1]) / 2
            r, c = stats[: s[0]], stats[s[0]:]
            part = (torch.outer(r, c) / r.mean()).sqrt()
            scale[at: at + n] = (part + 1e-3 * part.mean()).reshape(-1)
        at += n
    return scale


class Reference:
    """The plain two-phase exchange on `buf / scale`, its residuals in scaled units re-read at each new scale."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.state = codecs.TwoPhaseState(codecs.SignCodec(BLOCK), group, True)
        self.prev: torch.Tensor | None = None

    def mean(self, buf: torch.Tensor, scale: torch.Tensor, spans: list) -> torch.Tensor:
        buf, scale = buf.clone(), scale.clone()
        transpose_spans(buf, spans)
        transpose_spans(scale, spans)
        if self.prev is not None:
            self.reread(scale, buf.numel())
        self.prev = scale
        out = codecs.two_phase_mean(self.state, buf / scale, 0).wait() * scale
        transpose_spans(out, spans, back=True)
        return out

    def reread(self, scale: torch.Tensor, numel: int) -> None:
        worker, server, st = self.state.worker[0], self.state.server[0], self.state
        worker[:numel].mul_(self.prev).div_(scale)
        start = C.rank(st.group) * codecs.chunk_len(st.codec, numel, C.size(st.group))
        part = slice(start, start + server.numel())
        server[: scale[part].numel()].mul_(self.prev[part]).div_(scale[part])


def gradient_worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    hook, state = make_hook(CompressionConfig(method="sign", block_size=BLOCK, warmup_steps=0), group)
    reference, out = Reference(group), {"hook": [], "reference": [], "bytes": []}
    for t in range(STEPS):
        g = gradient(rank, t)
        out["reference"].append(reference.mean(g, reference_scale(g, group), SPANS))
        C.COUNTER.reset()
        out["hook"].append(hook(state, bucket_of(g.clone())).wait().clone())
        out["bytes"].append(dict(C.COUNTER.bytes))
    return out


def error_worker(rank: int, world: int) -> dict:
    """One step of sign with and without the scale: each element's error against its own magnitude."""
    group = dist.new_group(list(range(world)))
    out = {}
    for scale in ("auto", "none"):
        hook, state = make_hook(CompressionConfig(method="sign", warmup_steps=0, scale=scale), group)
        out[scale] = hook(state, bucket_of(gradient(rank, 0))).wait().clone()
    exact = gradient(rank, 0)
    dist.all_reduce(exact, group=group)
    out["exact"] = exact / world
    return out


def run(rank: int, world: int) -> dict:
    return {"gradient": gradient_worker(rank, world), "error": error_worker(rank, world)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    torch.set_num_threads(1)
    return run_ranks(run, 2, timeout=TIMEOUT)


def test_the_gradient_hook_is_the_codec_on_scaled_values_with_consistent_residuals(ranks: list[dict]) -> None:
    """Bit for bit the reference, every step (the residuals carried across scales that change with the
    gradient), the weight laid out by columns as well; the ranks agree."""
    for r in ranks:
        for hooked, ref in zip(r["gradient"]["hook"], r["gradient"]["reference"]):
            assert torch.equal(hooked, ref)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["gradient"]["hook"], ranks[1]["gradient"]["hook"]))


def test_the_bytes_are_the_codecs_and_the_statistics(ranks: list[dict]) -> None:
    """Per step: the all-reduce of the statistics (`scaling.stats_bytes`: 24 + 40 + 6 + 20 floats) and the
    two-phase exchange's payload (`codecs.payload_bytes`), nothing else."""
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    two_phase = codecs.payload_bytes(codecs.SignCodec(BLOCK), numel, 2)
    for r in ranks:
        for counted in r["gradient"]["bytes"]:
            by_op = {op: b for (_, op), b in counted.items()}
            assert by_op.pop("all_reduce") == scaling.stats_bytes(SHAPES) == 4 * (24 + 40 + 6 + 20)
            assert sum(by_op.values()) == two_phase


def test_the_scale_cuts_the_error_where_rows_and_columns_differ(ranks: list[dict]) -> None:
    """Each element of the weight's mean against the exact mean, relative to the rows' and columns' magnitude:
    the first step's error with the scale well under half of without it."""
    for r in ranks:
        n = SHAPES[0][0] * SHAPES[0][1]
        exact = r["error"]["exact"][:n].view(SHAPES[0])
        magnitude = exact.abs().mean(1, keepdim=True).sqrt() * exact.abs().mean(0, keepdim=True).sqrt()
        err = {k: float(((r["error"][k][:n].view(SHAPES[0]) - exact).abs() / magnitude).mean())
               for k in ("auto", "none")}
        assert err["auto"] < 0.5 * err["none"], err
