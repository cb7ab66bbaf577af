"""Sinusoidal encoding against the formula of Vaswani et al. 2017, §3.5, computed with math."""

import math

import pytest
import torch

from attnlab.components.positions.sinusoidal import SinusoidalPosition, sinusoidal_table


@pytest.mark.parametrize("d_model", [16, 512, 7])
def test_table_matches_paper_formula(d_model):
    table = sinusoidal_table(2048, d_model)
    assert table.shape == (2048, d_model) and table.dtype == torch.float32
    for pos in (0, 1, 5, 100, 2047):
        for col in sorted({0, 1, 2, 3, d_model // 2, d_model - 2, d_model - 1}):
            i = col // 2  # columns 2i and 2i + 1 share the wavelength base^(2i / d_model)
            angle = pos / 10000.0 ** (2 * i / d_model)
            expected = math.sin(angle) if col % 2 == 0 else math.cos(angle)
            assert table[pos, col].item() == pytest.approx(expected, abs=1e-6), (pos, col)


def test_custom_base():
    table = sinusoidal_table(10, 8, base=100.0)
    assert table[7, 3].item() == pytest.approx(math.cos(7 / 100.0 ** (2 / 8)), abs=1e-6)


def test_embed_adds_table_rows():
    torch.manual_seed(0)
    module = SinusoidalPosition(d_model=8, max_seq_len=32)
    x = torch.randn(2, 5, 8)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    out = module.embed(x, pos)
    assert out.shape == (2, 5, 8)
    torch.testing.assert_close(out[1, 2] - x[1, 2], sinusoidal_table(32, 8)[9])
    # Shared (T,) positions broadcast over the batch.
    torch.testing.assert_close(module.embed(x, torch.arange(5)), x + sinusoidal_table(32, 8)[:5])
    assert module.embed(x.bfloat16(), torch.arange(5)).dtype == torch.bfloat16
    assert module.state_dict() == {}  # the table is a non-persistent buffer


def test_out_of_range_position_raises():
    module = SinusoidalPosition(d_model=8, max_seq_len=32)
    with pytest.raises(ValueError, match=r"position 40 .*max_seq_len=32"):
        module.embed(torch.zeros(1, 3, 8), torch.tensor([0, 40, 1]))
    with pytest.raises(ValueError, match="position -1"):
        module.embed(torch.zeros(1, 1, 8), torch.tensor([-1]))
    with pytest.raises(ValueError, match="d_model=0"):
        SinusoidalPosition(d_model=0, max_seq_len=8)
