"""Logit soft-capping (Gemma 2): cap * tanh(x / cap), in attention before the mask."""

import torch

from attnlab.components.backends import eager_attention
from attnlab.components.softcap import soft_cap


def test_soft_cap_bounds_and_keeps_small_logits():
    x = torch.linspace(-1000, 1000, 101)
    y = soft_cap(x, 30.0)
    assert y.abs().max() <= 30.0 and torch.all(y.diff() >= 0)  # bounded, still monotone
    small = torch.tensor([1e-3, -2e-3])
    torch.testing.assert_close(soft_cap(small, 30.0), small, rtol=1e-5, atol=0)


def test_eager_attention_caps_scores_before_the_mask():
    q, k, v = torch.randn(1, 2, 4, 8) * 5, torch.randn(1, 2, 4, 8) * 5, torch.randn(1, 2, 4, 8)
    out, probs = eager_attention(q, k, v, is_causal=True, softcap=2.0, return_weights=True)
    scores = soft_cap(q @ k.transpose(-2, -1) * 8**-0.5, 2.0)  # the formula, written here
    scores = scores.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(probs, scores.softmax(-1))
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_hooked_scores_of_a_capped_layer_are_capped():
    """hook_scores sees the scores the layer attends with: soft-capped, then masked."""
    from attnlab.components.attention import Attention

    torch.manual_seed(0)
    layer = Attention(16, 2, backend="eager", softcap=0.5).eval()
    seen = []
    layer.hook_scores.add(lambda s, point: seen.append(s) or s)
    x = torch.randn(1, 5, 16) * 10
    with torch.no_grad():
        out = layer(x)
        layer.hook_scores.fns.clear()
        assert torch.allclose(out, layer(x), atol=1e-6)  # the hooked path attends the same
    assert seen[0].isfinite().all() and seen[0].abs().max() <= 0.5
