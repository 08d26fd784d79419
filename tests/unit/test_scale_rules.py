"""The block codecs' scaled values (`hybrid.compression.scaling`), in one process: where a bucket's matrices lie and
what their statistics cost, the factored scale against Adafactor's estimate written out, its floors, which methods
`compression.scale` scales, the config's one-line errors, and what it is for — the sign codec's error on a
gradient whose rows and columns differ in scale by orders of magnitude."""

from __future__ import annotations

import pytest
import torch

from hybrid.compression import CompressionError, codecs, registry, scaling
from hybrid.config import CompressionConfig
from hybrid.config_sync import METHOD_KNOBS, SCALED_CODECS

SHAPES = [(6, 40), (40,), (8, 5, 4), (0, 3), (3, 7), (5, 1), (1, 6)]


def test_matrices_and_the_statistics_bytes() -> None:
    """Gradients of two or more dimensions, as rows × the rest, at their offsets in the packed bucket; 1-D, empty
    and one-row or one-column gradients (hierarchical's pieces of a bias) are not matrices. The statistics'
    all-reduce sends rows + cols fp32 floats per matrix."""
    assert scaling.matrices(SHAPES) == [(0, 6, 40), (280, 8, 20), (440, 3, 7)]
    assert scaling.stats_bytes(SHAPES) == 4 * (6 + 40 + 8 + 20 + 3 + 7)
    assert scaling.stats_bytes([(40,), (7,), (9, 1)]) == 0


def test_the_factored_scale_is_adafactors_estimate_floored() -> None:
    """Each matrix's scale is √(Rᵢ·Cⱼ / mean R) (R, C its rows' and columns' mean squares) plus 10⁻³ of its mean;
    the bucket's 1-D gradients keep scale 1; a bucket without a matrix has none; a zero matrix keeps 1."""
    torch.manual_seed(0)
    grads = [torch.randn(s) * (1 + torch.arange(s[0]).view(-1, *[1] * (len(s) - 1))) for s in SHAPES]
    grads[4].zero_()
    buf = torch.cat([g.reshape(-1) for g in grads])
    scale = scaling.factored_scale(buf, SHAPES, None)  # a group of one: the statistics are this rank's
    for (at, rows, cols), g in zip(scaling.matrices(SHAPES), [grads[0], grads[2], grads[4]]):
        sq = g.reshape(rows, cols).pow(2)
        r, c = sq.mean(1), sq.mean(0)
        want = (torch.outer(r, c) / r.mean()).sqrt() if r.sum() > 0 else torch.ones(rows, cols)
        want = want + 1e-3 * want.mean() if r.sum() > 0 else want
        torch.testing.assert_close(scale[at: at + rows * cols].view(rows, cols), want)
    assert torch.equal(scale[240:280], torch.ones(40))
    assert scaling.factored_scale(torch.randn(47), [(40,), (7,)], None) is None


@pytest.mark.parametrize("scale,scaled", [("auto", {"sign"}), ("factored", {"int8", "int4", "sign"}), ("none", set())])
def test_which_methods_each_setting_scales(scale: str, scaled: set[str]) -> None:
    """auto: sign (measured to gain); factored: the gradient's block codecs, the methods the resume check counts
    the knob for (`config_sync.SCALED_CODECS`); never top-k, PowerSGD or the Adam pair's momentum."""
    cfg = CompressionConfig(scale=scale)
    assert {m for m in registry.METHODS if scaling.scaled(cfg, m)} == scaled
    assert set(scaling.FACTORED) == SCALED_CODECS == METHOD_KNOBS["scale"]
    assert scaling.run_scaled(CompressionConfig(method="hierarchical", inner="sign", scale=scale)) == ("sign" in scaled)


@pytest.mark.parametrize("overrides,message", [
    ({"method": "sign", "scale": "rows"}, "compression.scale must be one of auto, factored, none, got 'rows'"),
    ({"method": "onebit_adam", "scale": "factored"}, "compression.scale=factored applies to the gradient's block "
     "codecs int8, int4, sign (or hierarchical's inner one of them), not compression=onebit_adam; auto or none"),
])
def test_a_bad_scale_is_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(CompressionError) as err:
        registry.check(CompressionConfig(**overrides))
    assert str(err.value) == message
    registry.check(CompressionConfig(method="hierarchical", inner="int8", scale="factored"))


def heavy_gradient(rows: int = 64, cols: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient whose rows' and columns' scales each span 10^±1.5 (residual-stream dimensions × SwiGLU channels),
    and its true magnitude per element."""
    gen = torch.Generator().manual_seed(3)
    magnitude = torch.outer(10 ** (torch.rand(rows, generator=gen) * 3 - 1.5),
                            10 ** (torch.rand(cols, generator=gen) * 3 - 1.5))
    return torch.randn(rows, cols, generator=gen) * magnitude, magnitude


def test_scaled_values_fit_the_sign_codecs_blocks() -> None:
    """The sign codec (blocks of 256: one row) on a gradient with heavy rows and columns, error against each
    element's own magnitude (what Adam's per-element normalisation sees): well under half with the factored scale."""
    g, magnitude = heavy_gradient()
    codec = codecs.SignCodec(256)

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        return codec.decode(codec.encode(flat), flat.numel()).view_as(x)

    scale = scaling.factored_scale(g.reshape(-1).clone(), [g.shape], None).view_as(g)
    plain = ((round_trip(g) - g).abs() / magnitude).mean()
    scaled = ((round_trip(g / scale) * scale - g).abs() / magnitude).mean()
    assert scaled < 0.5 * plain, (float(scaled), float(plain))
