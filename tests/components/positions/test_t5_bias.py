"""T5 relative position buckets and bias against HF's T5Attention, plus the j - i property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.positions.t5_bias import T5Bias, relative_position_bucket

RELATIVE = torch.cat(
    (torch.arange(-300, 301), torch.tensor([-(10**6), -4096, -129, -128, 128, 129, 4096, 10**6]))
)


@pytest.mark.hf
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (64, 256)])
def test_buckets_match_hf(bidirectional, num_buckets, max_distance):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    ref = T5Attention._relative_position_bucket(RELATIVE, bidirectional, num_buckets, max_distance)
    ours = relative_position_bucket(RELATIVE, bidirectional, num_buckets, max_distance)
    assert ours.dtype == torch.long
    torch.testing.assert_close(ours, ref)


def test_bucket_layout_spot_values():
    # Bidirectional, 32 buckets: 16 per direction, 8 exact then log-spaced up to distance 128.
    rel = torch.tensor([0, -1, -7, -8, -127, -128, -5000, 1, 7, 5000])
    assert relative_position_bucket(rel, True).tolist() == [0, 1, 7, 8, 15, 15, 15, 17, 23, 31]
    # Causal: keys ahead of the query (rel > 0) collapse to bucket 0.
    assert relative_position_bucket(torch.tensor([3, 0, -3, -15, -16]), False).tolist() == [
        0, 0, 3, 15, 16,
    ]  # fmt: skip


@pytest.mark.hf
@pytest.mark.parametrize("is_decoder", [False, True])
def test_score_bias_matches_hf_compute_bias(is_decoder):
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    config = transformers.T5Config(
        d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, is_decoder=is_decoder,
    )  # fmt: skip
    torch.manual_seed(0)
    ref_attn = T5Attention(config, has_relative_attention_bias=True)
    ours = T5Bias(n_heads=4, num_buckets=32, max_distance=128, bidirectional=not is_decoder)
    ours.load_state_dict(
        {"relative_attention_bias.weight": ref_attn.relative_attention_bias.weight}
    )  # same key as HF
    T, S = 150, 160
    ref = ref_attn.compute_bias(T, S)  # (1, H, T, S), queries at 0..T-1
    bias = ours.score_bias(torch.arange(T), torch.arange(S))
    assert bias.shape == (4, T, S) and bias.dtype == torch.float32
    torch.testing.assert_close(bias, ref[0])


def test_batched_positions_shape():
    t5 = T5Bias(n_heads=3)
    q_pos, k_pos = torch.tensor([[2, 3], [5, 6]]), torch.arange(7).expand(2, 7)
    bias = t5.score_bias(q_pos, k_pos)
    assert bias.shape == (2, 3, 2, 7)
    torch.testing.assert_close(bias[1], t5.score_bias(q_pos[1], k_pos[1]))


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 8),
    S=st.integers(1, 8),
    offset=st.integers(0, 10_000),
    bidirectional=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bias_depends_only_on_relative_position(T, S, offset, bidirectional, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    t5 = T5Bias(n_heads=2, bidirectional=bidirectional)
    q_pos, k_pos = (
        torch.randint(0, 300, (T,), generator=gen),
        torch.randint(0, 300, (S,), generator=gen),
    )
    torch.testing.assert_close(
        t5.score_bias(q_pos + offset, k_pos + offset), t5.score_bias(q_pos, k_pos)
    )


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="n_heads=0"):
        T5Bias(n_heads=0)
    with pytest.raises(ValueError, match="num_buckets=2"):
        T5Bias(n_heads=2, num_buckets=2)
    with pytest.raises(ValueError, match="max_distance=8"):
        T5Bias(n_heads=2, num_buckets=32, max_distance=8)
