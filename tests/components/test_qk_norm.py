"""QK-norm: per head (Qwen3) and over the whole projection (OLMo 2), against the formula."""

import pytest
import torch

from attnlab.components.norms import rms_norm_reference
from attnlab.components.qk_norm import QKNorm


def test_per_head_normalises_each_head_alone():
    x = torch.randn(2, 5, 3, 8)  # (B, T, N, D)
    norm = QKNorm(3, 8, "head", 1e-6)
    norm.weight.data = torch.randn(8)
    assert norm.weight.shape == (8,)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-6))


def test_projection_scope_normalises_all_heads_together():
    x = torch.randn(2, 5, 3, 8)
    x[:, :, 0] *= 10  # one loud head: a shared statistic keeps the others quiet
    norm = QKNorm(3, 8, "projection", 1e-6)
    norm.weight.data = torch.randn(24)
    expected = rms_norm_reference(x.flatten(-2), norm.weight, 1e-6).view_as(x)
    torch.testing.assert_close(norm(x), expected)
    per_head, whole = QKNorm(3, 8, "head", 1e-6), QKNorm(3, 8, "projection", 1e-6)
    assert not torch.allclose(per_head(x)[:, :, 1:], whole(x)[:, :, 1:])  # the scopes differ


def test_unit_offset_scales_by_one_plus_weight():
    x = torch.randn(4, 2, 1, 8)
    norm = QKNorm(1, 8, "head", 1e-6, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(8))  # the identity scale
    norm.weight.data = torch.randn(8)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, 1 + norm.weight, 1e-6))


def test_unknown_scope_is_named():
    with pytest.raises(ValueError, match="scope 'layer'"):
        QKNorm(2, 8, "layer", 1e-6)
