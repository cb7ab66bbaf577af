"""The eager and sdpa attention backends against `F.scaled_dot_product_attention` called directly.

The reference masks are built here from `torch.tril` / `torch.arange`, not from attnlab.masks, and
GQA is checked against SDPA on k/v expanded with `repeat_interleave`.
"""

import pytest
import torch
import torch.nn.functional as F

from attnlab.components.backends import BACKENDS, eager_attention, sdpa_attention

ATOL = 1e-5  # fp32, max abs difference
B, H, T, S, D = 2, 4, 5, 7, 8


def _qkv(B=B, H=H, K=H, T=T, S=S, D=D):
    q = torch.randn(B, H, T, D)
    k = torch.randn(B, K, S, D)
    v = torch.randn(B, K, S, D)
    return q, k, v


def _ref_causal(T: int, S: int) -> torch.Tensor:
    """(T, S) bool: the T queries are the last T of S positions (bottom-right aligned)."""
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)


def _ref_padding(lengths: list[int], S: int) -> torch.Tensor:
    """(B, 1, 1, S) bool key-padding mask, right padded, True = a real token."""
    return (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "case",
    ["none", "causal", "causal_square", "padding", "combined", "bias", "bias_and_mask", "all"],
)
def test_backend_matches_torch_sdpa(backend, case):
    T_ = S if case == "causal_square" else T
    q, k, v = _qkv(T=T_)
    pad = _ref_padding([S, 3], S)
    bias = torch.randn(H, T_, S)
    mask, our_bias, is_causal, ref_mask, ref_causal = None, None, False, None, False
    if case in ("causal", "causal_square"):
        is_causal = True
        if T_ == S:
            ref_causal = True  # SDPA's own causal flag is exact for square scores
        else:
            ref_mask = _ref_causal(T_, S)
    elif case == "padding":
        mask, ref_mask = pad, pad
    elif case == "combined":
        mask, is_causal, ref_mask = pad, True, pad & _ref_causal(T_, S)
    elif case == "bias":
        our_bias, ref_mask = bias, bias
    elif case == "bias_and_mask":
        our_bias, mask = bias, pad
        ref_mask = bias + torch.zeros(S).masked_fill(~pad, float("-inf"))  # (B, H, T, S)
    elif case == "all":  # bias, padding and causal together
        our_bias, mask, is_causal = bias, pad, True
        allowed = pad & _ref_causal(T_, S)  # (B, 1, T, S)
        ref_mask = bias + torch.zeros(S).masked_fill(~allowed, float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, is_causal=ref_causal)
    out, weights = BACKENDS[backend](q, k, v, mask=mask, bias=our_bias, is_causal=is_causal)
    assert out.shape == (B, H, T_, D) and weights is None
    _close(out, expected)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_custom_scale_matches_torch_sdpa(backend):
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    _close(BACKENDS[backend](q, k, v, scale=0.3)[0], expected)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_sdpa_on_repeated_kv(backend, K, causal):
    q, k, v = _qkv(K=K)
    G = H // K
    k_full, v_full = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, S, D)
    ref_mask = _ref_causal(T, S) if causal else None
    expected = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=ref_mask)
    _close(BACKENDS[backend](q, k, v, is_causal=causal)[0], expected)


def test_eager_weights_are_probabilities_with_zeros_where_masked():
    q, k, v = _qkv()
    mask = _ref_padding([S, 3], S) & _ref_causal(T, S)  # (B, 1, T, S), no empty row
    out, w = eager_attention(q, k, v, mask=mask, return_weights=True)
    assert w.shape == (B, H, T, S) and w.dtype == torch.float32
    _close(w.sum(-1), torch.ones(B, H, T))
    assert (w.masked_select(~mask.expand_as(w)) == 0).all()  # exactly zero, not just small
    scores = (q @ k.transpose(-2, -1)) / D**0.5  # (B, H, T, S), the textbook formula
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    _close(w, expected)
    _close(out, w @ v)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_rows_give_zeros_not_nan(backend, with_bias):
    q, k, v = _qkv()
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, 0, 1] = False  # batch row 0, query 1 may attend to nothing
    mask[1, 0, :, :] = False  # batch row 1 is padding throughout
    bias = torch.randn(H, T, S) if with_bias else None
    out, _ = BACKENDS[backend](q, k, v, mask=mask, bias=bias)
    assert not out.isnan().any()
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    ref_mask = mask if bias is None else bias + torch.zeros(1).masked_fill(~mask, float("-inf"))
    expected = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=ref_mask[:1])
    _close(out[0, :, [0, 2, 3, 4]], expected[0, :, [0, 2, 3, 4]])  # the other rows are unchanged


def test_eager_fully_masked_row_weights_are_zero():
    q, k, v = _qkv()
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[2] = False
    _, w = eager_attention(q, k, v, mask=mask, return_weights=True)
    assert not w.isnan().any() and (w[:, :, 2] == 0).all()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_dropout_changes_output_only_when_positive(backend):
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v)
    _close(BACKENDS[backend](q, k, v, dropout=0.0)[0], expected)
    dropped = BACKENDS[backend](q, k, v, dropout=0.5)[0]
    assert (dropped - expected).abs().max() > 1e-2


def test_eager_dropout_zeroes_and_rescales_probabilities():
    # Dropout acts on the probabilities: every output is sum_j keep_j / (1 - p) * P_ij v_j.
    q, k, v = _qkv()
    torch.manual_seed(1)
    out, w = eager_attention(q, k, v, dropout=0.5, return_weights=True)
    torch.manual_seed(1)
    keep = F.dropout(torch.ones_like(w), p=0.5)  # the same draw: entries are 0 or 2
    _close(out, (w * keep) @ v)


def test_sdpa_cannot_return_weights():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="eager"):
        sdpa_attention(q, k, v, return_weights=True)
