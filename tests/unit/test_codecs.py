"""Compression codecs and the pure helpers of PowerSGD and hierarchical sync, without a process group.

References: the codecs' definitions (absmax/127 int8 per block, mean|x|·sign per block, the k largest
magnitudes from `torch.topk`), PyTorch's own PowerSGD compression rule (`_should_compress`), and the
matrix views of the gradients for the row ranges.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from hybrid.compression import codecs, powersgd
from hybrid.compression.hierarchical import piece_shapes, row_ranges

CODECS = [codecs.Int8Codec(4), codecs.Int8Codec(32), codecs.Int8Codec(256), codecs.Int4Codec(4), codecs.Int4Codec(32),
          codecs.Int4Codec(3), codecs.Fp8Codec(32), codecs.SignCodec(32),
          codecs.SignCodec(256), codecs.TopKCodec(0.01), codecs.TopKCodec(0.1), codecs.TopKCodec(0.5),
          codecs.TopKCodec(1.0)]
NUMELS = [1, 7, 100, 1000, 3121]
RANKS = [1, 2, 3, 4, 8]


def codec_id(c: codecs.Codec) -> str:
    return f"{type(c).__name__}-{getattr(c, 'block', getattr(c, 'fraction', ''))}"


def test_every_registered_codec_is_a_two_phase_method() -> None:
    """CODECS is the one list: each entry builds a Codec from the compression config and becomes a method of
    the hook registry, with error feedback where its spec says so; the block codecs lay row-parallel weights
    out column by column unless `compression.block_layout=rows`; sign runs on factored-scaled values unless
    `compression.scale=none` (`scaling.py`)."""
    from hybrid.compression import layout, registry, scaling
    from hybrid.config import CompressionConfig

    cfg = CompressionConfig(block_size=32, fraction=0.1, scale="none")
    built = {name: spec.build(cfg) for name, spec in codecs.CODECS.items()}
    assert {n: codec_id(c) for n, c in built.items()} == {"int8": "Int8Codec-32", "int4": "Int4Codec-32",
                                                          "sign": "SignCodec-32", "topk": "TopKCodec-0.1"}
    for name, codec in built.items():
        assert isinstance(codec, codecs.Codec) and name in registry.METHODS
        hook, state = registry.REGISTRY[name](cfg, None)
        assert hook is (codecs.two_phase_hook if name == "topk" else layout.column_hook)
        assert codec_id(state.codec) == codec_id(codec)
        assert registry.REGISTRY[name](CompressionConfig(block_layout="rows", scale="none"), None)[0] is \
            codecs.two_phase_hook
        auto = registry.REGISTRY[name](CompressionConfig(), None)
        assert (auto[0] is scaling.factored_hook) == (name == "sign")
        assert name != "sign" or auto[1].columns  # and laid out by columns under it
        assert state.error_feedback == codecs.CODECS[name].error_feedback
        assert not registry.REGISTRY[name](CompressionConfig(error_feedback=False), None)[1].error_feedback


def blocky(length: int, block: int, seed: int = 0) -> torch.Tensor:
    """Random values whose blocks differ in scale by up to 10^±3 (so per-block scales matter)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, generator=gen)
    scales = 10.0 ** (torch.rand(math.ceil(length / block), generator=gen) * 6 - 3)
    return x * scales.repeat_interleave(block)[:length]


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_encoded_length_is_encoded_bytes(codec: codecs.Codec) -> None:
    for size in NUMELS:
        for n in RANKS:
            length = codecs.chunk_len(codec, size, n)
            data = codec.encode(torch.randn(length))
            assert data.dtype == torch.uint8 and data.dim() == 1
            assert data.numel() == codec.encoded_bytes(length), (size, n)
            expected = 0 if n == 1 else 2 * n * codec.encoded_bytes(length)
            assert codecs.payload_bytes(codec, size, n) == expected


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_chunk_len_is_the_smallest_aligned_cover(codec: codecs.Codec) -> None:
    align = {codecs.Int8Codec: lambda c: c.block, codecs.Fp8Codec: lambda c: c.block,
             codecs.Int4Codec: lambda c: math.lcm(c.block, 2),
             codecs.SignCodec: lambda c: math.lcm(c.block, 8), codecs.TopKCodec: lambda c: 1}[type(codec)](codec)
    for size in NUMELS:
        for n in RANKS:
            share = math.ceil(size / n)
            length = codecs.chunk_len(codec, size, n)
            assert length % align == 0 and n * length >= size
            assert share <= length < share + align, (size, n, length)


# block sizes the config accepts (compression.block_size > 0), including ones not a multiple of 4 or 32
BLOCKS = [1, 3, 8, 16, 24, 32, 100, 256]


@pytest.mark.parametrize("make", [codecs.Int8Codec, codecs.Int4Codec, codecs.Fp8Codec, codecs.SignCodec],
                         ids=["int8", "int4", "fp8", "sign"])
@pytest.mark.parametrize("block", BLOCKS)
def test_decode_reads_every_chunk_of_a_stack(make: type, block: int) -> None:
    """The two-phase hook decodes rows of a stack of encoded chunks (the all-to-all / all-gather
    buffers): each row decodes like the chunk on its own, whatever block_size the config allows."""
    codec = make(block)
    for size, n in [(9, 1), (10, 1), (21, 2), (100, 3), (1000, 4)]:
        length = codecs.chunk_len(codec, size, n)
        chunks = [blocky(length, block, seed=k) for k in range(n)]
        stacked = torch.stack([codec.encode(c) for c in chunks])
        for k, c in enumerate(chunks):
            alone = codec.decode(codec.encode(c).clone(), length)
            torch.testing.assert_close(codec.decode(stacked[k], length), alone, rtol=0, atol=0)


@pytest.mark.parametrize("make", [codecs.Int8Codec, codecs.Int4Codec], ids=["int8", "int4"])
@pytest.mark.parametrize("block", [4, 32, 256])
def test_absmax_error_is_at_most_half_a_step_per_block(make: type, block: int) -> None:
    """int8: steps of absmax/127; int4: absmax/7, two values a byte."""
    codec = make(block)
    length = codecs.chunk_len(codec, 5000, 1)
    x = blocky(length, block)
    y = codec.decode(codec.encode(x), length)
    absmax = x.view(-1, block).abs().amax(1).repeat_interleave(block)
    err = (y - x).abs()
    assert bool((err <= absmax / (2 * codec.LEVELS) * (1 + 1e-5)).all()), float((err / absmax).max())
    assert float(err.max()) > 0  # it is lossy
    assert float(err.max()) > float(absmax.max()) / (2 * codec.LEVELS) / 4  # and as coarse as its levels
    # the absmax element of each block is one of the 2·LEVELS + 1 levels: kept up to fp32 rounding
    top = x.view(-1, block).abs().argmax(1) + torch.arange(0, length, block)
    torch.testing.assert_close(y[top], x[top], rtol=1e-6, atol=0)


@pytest.mark.parametrize("block", [32, 256])
def test_sign_is_the_block_mean_magnitude_times_the_sign(block: int) -> None:
    codec = codecs.SignCodec(block)
    length = codecs.chunk_len(codec, 3000, 1)
    x = blocky(length, block)
    x[5] = 0.0  # zero counts as positive
    scale = x.view(-1, block).abs().mean(1).repeat_interleave(block)
    expected = torch.where(x >= 0, 1.0, -1.0) * scale
    torch.testing.assert_close(codec.decode(codec.encode(x), length), expected, rtol=0, atol=0)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.37, 1.0])
def test_topk_keeps_exactly_the_k_largest_magnitudes(fraction: float) -> None:
    codec = codecs.TopKCodec(fraction)
    for length in (1, 50, 1000):
        x = torch.randn(length, generator=torch.Generator().manual_seed(length))
        k = max(1, math.ceil(fraction * length))
        y = codec.decode(codec.encode(x), length)
        kept = set(torch.topk(x.abs(), k).indices.tolist())
        assert set(y.nonzero().view(-1).tolist()) == kept
        idx = torch.tensor(sorted(kept))
        torch.testing.assert_close(y[idx], x[idx], rtol=0, atol=0)


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_all_zero_input_decodes_to_zero(codec: codecs.Codec) -> None:
    length = codecs.chunk_len(codec, 1000, 2)
    y = codec.decode(codec.encode(torch.zeros(length)), length)
    assert torch.equal(y, torch.zeros(length))


@pytest.mark.parametrize("make", [lambda: codecs.Int8Codec(32), lambda: codecs.Int4Codec(32),
                                  lambda: codecs.Fp8Codec(32), lambda: codecs.SignCodec(32)],
                         ids=["int8", "int4", "fp8", "sign"])
def test_zero_block_between_nonzero_blocks_stays_zero(make: object) -> None:
    codec = make()
    x = blocky(128, 32)
    x[32:64] = 0
    y = codec.decode(codec.encode(x), 128)
    assert torch.equal(y[32:64], torch.zeros(32)) and torch.isfinite(y).all()


@pytest.mark.parametrize("block", [4, 32, 256])
def test_fp8_error_is_relative_in_a_blocks_normal_range(block: int) -> None:
    """Scaled to ±448, e4m3 keeps 3 mantissa bits: |error| ≤ 2⁻⁴·|x| where x/scale is normal (≥ 2⁻⁶), at most half
    a subnormal step (2⁻¹⁰·scale) below; and the largest magnitude of each block is exact."""
    codec = codecs.Fp8Codec(block)
    x = blocky(4 * block, block)
    y = codec.decode(codec.encode(x), x.numel())
    scale = (x.view(-1, block).abs().amax(1) / 448).repeat_interleave(block)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all(), ((y - x).abs() / bound).max()
    top = x.view(-1, block).abs().argmax(1) + torch.arange(0, x.numel(), block)
    torch.testing.assert_close(y[top], x[top], rtol=1e-6, atol=0)


def test_the_parameter_codecs_are_int8_and_fp8_by_block_size() -> None:
    assert {n: codec_id(make(16)) for n, make in codecs.PARAM_CODECS.items()} == {"int8": "Int8Codec-16",
                                                                                  "fp8": "Fp8Codec-16"}


# ---- PowerSGD's compression rule against PyTorch's ----------------------------------------------------

SHAPE_GRID = [(48,), (1, 1), (7, 3), (3, 100), (100, 3), (20, 30), (64, 48), (16, 8, 4), (512, 64), (5, 30)]


@pytest.mark.parametrize("rate", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_powersgd_compresses_what_pytorch_compresses(rank: int, rate: float) -> None:
    """compressed_rank / payload_bytes follow `powerSGD_hook._should_compress` on each gradient's
    (shape[0], rest) view, the elements PyTorch's own hook sends."""
    sent = 0
    for shape in SHAPE_GRID:
        rows, cols = shape[0], math.prod(shape) // shape[0]
        r = min(rows, cols, rank)
        compress, full, low = _should_compress(rows, cols, r, rate)
        assert powersgd.compressed_rank(torch.Size(shape), rank, rate) == (r if compress else 0), shape
        sent += low if compress else full
    assert powersgd.payload_bytes([torch.Size(s) for s in SHAPE_GRID], rank, rate) == 4 * sent


# ---- hierarchical: row ranges ------------------------------------------------------------------------

def random_shapes(gen: torch.Generator, count: int) -> list[torch.Size]:
    out = []
    for _ in range(count):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        dims = [int(d) for d in torch.randint(1, 60, (kind + 1,), generator=gen)]
        out.append(torch.Size(dims))
    return out


def test_row_ranges_are_contiguous_row_aligned_and_balanced() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [[torch.Size(s) for s in shapes] for shapes in ([(64, 48), (48,)], [(48, 32), (32,), (16, 8, 4)],
                                                           [(3, 100), (3,)], [(1000,)], [(2, 500), (10, 3)])]
    cases += [random_shapes(gen, int(torch.randint(1, 6, (1,), generator=gen))) for _ in range(40)]
    for shapes in cases:
        total = sum(s.numel() for s in shapes)
        starts, widths, offset = [], [], 0  # each tensor's offset and matrix-view row width
        for s in shapes:
            starts.append(offset)
            widths.append(powersgd.matrix_shape(s)[1])
            offset += s.numel()
        for parts in range(1, 9):
            ranges = row_ranges(shapes, parts)
            assert len(ranges) == parts
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
            assert all(lo <= hi for lo, hi in ranges)
            for j, (cut, _) in enumerate(ranges[1:], start=1):
                # on a row boundary of some tensor's matrix view (its start and end included)
                assert any(o <= cut <= o + s.numel() and (cut - o) % w == 0
                           for o, s, w in zip(starts, shapes, widths)), (shapes, parts, cut)
                # within one row of the even split: the row of the tensor the ideal cut falls in
                ideal = j * total // parts
                t = max(i for i, o in enumerate(starts) if o <= ideal) if ideal < total else len(shapes) - 1
                assert abs(cut - ideal) <= widths[t], (shapes, parts, j, cut, ideal)


def test_piece_shapes_are_the_row_blocks_inside_a_range() -> None:
    shapes = [torch.Size(s) for s in [(48, 32), (32,), (16, 8, 4)]]
    for parts in (1, 2, 3, 4, 7):
        for lo, hi in row_ranges(shapes, parts):
            pieces = piece_shapes(shapes, (lo, hi))
            assert sum(p.numel() for p in pieces) == hi - lo
            widths = [powersgd.matrix_shape(s)[1] for s in shapes]
            offset, expected = 0, []
            for s, w in zip(shapes, widths):
                a, b = max(lo, offset), min(hi, offset + s.numel())
                if b > a:
                    expected.append(torch.Size([(b - a) // w, w]))
                offset += s.numel()
            assert pieces == expected


def test_row_parallel_weights_are_laid_out_column_by_column() -> None:
    """`RowParallelLinear`'s weight is flagged (`column_blocks`), nothing else is; its span in a bucket is
    transposed in place and back, bit for bit; `compression.block_layout` takes auto or rows (one line)."""
    from hybrid.compression import CompressionError, registry
    from hybrid.compression.layout import column_spans, transpose_spans
    from hybrid.config import CompressionConfig
    from hybrid.parallel.tp.tensor import ColumnParallelLinear, RowParallelLinear

    col, row = ColumnParallelLinear(4, (6,), None), RowParallelLinear(6, 4, None)
    params = [*col.parameters(), *row.parameters()]
    at = sum(p.numel() for p in col.parameters())
    assert column_spans(params) == [(at, 4, 6)]
    flat = torch.randn(sum(p.numel() for p in params))
    moved = flat.clone()
    transpose_spans(moved, column_spans(params))
    assert torch.equal(moved[at: at + 24], flat[at: at + 24].view(4, 6).t().reshape(-1))
    assert torch.equal(moved[:at], flat[:at]) and torch.equal(moved[at + 24:], flat[at + 24:])
    transpose_spans(moved, column_spans(params), back=True)
    assert torch.equal(moved, flat)
    from hybrid.config_sync import BLOCK_CODECS

    blocked = {m for m, spec in codecs.CODECS.items() if hasattr(spec.build(CompressionConfig()), "block")}
    assert BLOCK_CODECS == blocked | {"onebit_adam", "zeroone_adam"}  # the resume check's readers of the knob
    with pytest.raises(CompressionError, match="compression.block_layout must be one of auto, rows, got 'cols'"):
        registry.check(CompressionConfig(method="sign", block_layout="cols"))
