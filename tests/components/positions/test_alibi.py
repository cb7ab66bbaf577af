"""ALiBi against Bloom's build_alibi_tensor and the paper's slopes, plus the j - i property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.positions.alibi import ALiBi, alibi_slopes


def _bloom_alibi(n_heads: int, seq_len: int) -> torch.Tensor:
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, seq_len, dtype=torch.long)
    return build_alibi_tensor(mask, n_heads, torch.float32)  # (H, 1, S): slope_h * j


def test_power_of_two_slopes_are_the_papers_sequence():
    # Press et al. 2022, §3: for 8 heads the slopes are 1/2^1, ..., 1/2^8.
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))


@pytest.mark.hf
@pytest.mark.parametrize("n_heads", [8, 12, 6, 5, 1, 16])
def test_slopes_match_bloom(n_heads):
    bloom = _bloom_alibi(n_heads, seq_len=4)
    torch.testing.assert_close(alibi_slopes(n_heads), bloom[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.hf
@pytest.mark.parametrize("n_heads", [8, 12, 6, 5])
def test_causal_softmax_matches_bloom(n_heads):
    T = 10
    bloom = _bloom_alibi(n_heads, seq_len=T)  # (H, 1, T)
    pos = torch.arange(T)
    ours = ALiBi(n_heads).score_bias(pos, pos)  # (H, T, T)
    assert ours.shape == (n_heads, T, T) and ours.dtype == torch.float32
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T) True = attend
    # Bloom's bias is slope * j; ours is -slope * (i - j): they differ by -slope * i per row.
    row_shift = (ours - bloom).masked_fill(~causal, 0.0)
    expected_shift = (-alibi_slopes(n_heads)[:, None, None] * pos[:, None]).expand_as(ours)
    torch.testing.assert_close(row_shift, expected_shift.masked_fill(~causal, 0.0))
    torch.manual_seed(0)
    scores = torch.randn(n_heads, T, T)
    p_ours = (scores + ours).masked_fill(~causal, float("-inf")).softmax(-1)
    p_bloom = (scores + bloom).masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(p_ours, p_bloom)


def test_batched_positions_shape_and_values():
    alibi = ALiBi(4)
    q_pos = torch.tensor([[3, 4], [0, 1]])  # (B, T)
    k_pos = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]])  # (B, S), e.g. left padding
    bias = alibi.score_bias(q_pos, k_pos)
    assert bias.shape == (2, 4, 2, 5)
    assert bias[0, 1, 1, 0].item() == pytest.approx(-alibi.slopes[1].item() * 4)
    torch.testing.assert_close(bias[1], alibi.score_bias(q_pos[1], k_pos[1]))
    assert alibi.state_dict() == {}


@settings(max_examples=25, deadline=None)
@given(
    n_heads=st.integers(1, 12),
    T=st.integers(1, 8),
    S=st.integers(1, 8),
    offset=st.integers(0, 10_000),
    seed=st.integers(0, 2**16),
)
def test_bias_depends_only_on_relative_position(n_heads, T, S, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    q_pos, k_pos = (
        torch.randint(0, 100, (T,), generator=gen),
        torch.randint(0, 100, (S,), generator=gen),
    )
    alibi = ALiBi(n_heads)
    torch.testing.assert_close(
        alibi.score_bias(q_pos + offset, k_pos + offset), alibi.score_bias(q_pos, k_pos)
    )


def test_bad_n_heads_raises():
    with pytest.raises(ValueError, match="n_heads=0"):
        ALiBi(0)
