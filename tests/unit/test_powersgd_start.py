"""PowerSGD's start from the exact warm-up's mean (`compression/start.py`): the randomized range finder against a
full SVD — its leading singular values, the energy beyond them and its right singular vectors."""

from __future__ import annotations

import pytest
import torch

from hybrid.compression.start import OVERSAMPLE, leading


def decaying(n: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An n × m matrix with singular values 0.8ʲ (a gradient's spectrum, decaying) and those values."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, min(n, m), generator=gen)).Q
    v = torch.linalg.qr(torch.randn(m, min(n, m), generator=gen)).Q
    s = 0.8 ** torch.arange(min(n, m), dtype=torch.float32)
    return (u * s) @ v.t(), s


def test_the_range_finder_gives_the_leading_spectrum_and_the_energy_beyond_it() -> None:
    m, s = decaying(300, 120, 0)
    squares, right = leading(m, 16, torch.Generator().manual_seed(1))
    width = 16 + OVERSAMPLE
    assert len(squares) == width + 1 and right.shape == (120, width)
    torch.testing.assert_close(torch.tensor(squares[:16]), s[:16].pow(2), rtol=1e-3, atol=1e-6)
    assert sum(squares) == pytest.approx(float(m.pow(2).sum()), rel=1e-5)  # the leading and the rest: all of it
    _, _, vh = torch.linalg.svd(m, full_matrices=False)
    overlap = (vh[:8] @ right[:, :8]).abs().diagonal()  # the same directions, up to sign
    assert float(overlap.min()) > 0.999


def test_a_narrow_matrix_is_decomposed_exactly() -> None:
    m, s = decaying(40, 12, 2)  # 12 ≤ k + OVERSAMPLE: the range is all of it
    squares, right = leading(m, 8, torch.Generator().manual_seed(3))
    torch.testing.assert_close(torch.tensor(squares[:12]), s.pow(2), rtol=1e-4, atol=1e-6)
    assert squares[12] < 1e-5
    torch.testing.assert_close(m @ right @ right.t(), m, rtol=1e-4, atol=1e-5)
