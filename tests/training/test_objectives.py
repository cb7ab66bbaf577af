"""Objectives against torch.nn.functional.cross_entropy, the reference implementation."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.training.objectives import (
    clm_loss,
    cross_entropy,
    mlm_loss,
    n_targets,
    seq2seq_loss,
)

B, T, V, PAD = 3, 7, 11, 0


def test_clm_equals_cross_entropy():
    logits, y = torch.randn(B, T, V), torch.randint(V, (B, T))
    want = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    torch.testing.assert_close(clm_loss(logits, y), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_with_padding_equals_torch(eps):
    logits = torch.randn(B, T, V) * 3
    labels = torch.randint(1, V, (B, T))
    labels[0, 4:] = PAD  # right padding, ignored
    labels[2, 1:] = PAD
    want = F.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=PAD, label_smoothing=eps
    )
    got = seq2seq_loss(logits, labels, PAD, label_smoothing=eps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got = cross_entropy(logits, labels, ignore_index=PAD, label_smoothing=eps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_mlm_ignores_unmasked_positions():
    logits, ids = torch.randn(B, T, V), torch.randint(V, (B, T))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5], labels[2, 0] = ids[0, 2], ids[1, 5], ids[2, 0]
    want = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(mlm_loss(logits, labels), want, rtol=1e-6, atol=1e-6)
    # Scores at positions without a label do not matter at all.
    changed = logits.clone()
    changed[labels == -100] = torch.randn(int((labels == -100).sum()), V) * 100
    assert mlm_loss(changed, labels) == mlm_loss(logits, labels)


def test_low_precision_logits_give_an_fp32_loss():
    logits, y = torch.randn(B, T, V), torch.randint(V, (B, T))
    got = clm_loss(logits.bfloat16(), y)
    assert got.dtype == torch.float32
    want = F.cross_entropy(logits.bfloat16().float().reshape(-1, V), y.reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gradient_matches_torch():
    logits = torch.randn(B, T, V, requires_grad=True)
    labels = torch.randint(1, V, (B, T))
    labels[1, 3:] = PAD
    seq2seq_loss(logits, labels, PAD, 0.1).backward()
    ours = logits.grad.clone()
    logits.grad = None
    F.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=PAD, label_smoothing=0.1
    ).backward()
    torch.testing.assert_close(ours, logits.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_sums_and_counts_equal_torch_reduction_sum(eps):
    """What the tasks give the loop: the loss summed over the counted targets (F.cross_entropy
    with reduction="sum") and their number; sum / count is torch's mean over them."""
    logits = torch.randn(B, T, V) * 3
    labels = torch.randint(1, V, (B, T))
    labels[1, 2:] = PAD
    flat = logits.reshape(-1, V), labels.reshape(-1)
    want = F.cross_entropy(*flat, ignore_index=PAD, label_smoothing=eps, reduction="sum")
    got = seq2seq_loss(logits, labels, PAD, eps, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert n_targets(labels, PAD) == int((labels != PAD).sum()) == B * T - (T - 2)
    mean = F.cross_entropy(*flat, ignore_index=PAD, label_smoothing=eps)
    torch.testing.assert_close(got / n_targets(labels, PAD), mean, rtol=1e-6, atol=1e-6)
    masked = torch.where(labels == PAD, -100, labels)
    torch.testing.assert_close(
        mlm_loss(logits, masked, reduction="sum"),
        F.cross_entropy(*flat, reduction="sum", ignore_index=PAD),
        rtol=1e-6,
        atol=1e-5,
    )
