"""Training objectives, written out: causal LM, masked LM, and seq2seq with label smoothing.

All three are the same cross-entropy, -log p(target), over the positions that count:
    CLM      every position predicts the next token           (Radford et al. 2018)
    MLM      only the masked positions (labels != -100)       (Devlin et al. 2019)
    seq2seq  every non-padding target token, with label smoothing eps: the target distribution is
             (1 - eps) on the right token plus eps spread uniformly over the vocabulary
             (Szegedy et al. 2016; Vaswani et al. 2017 §5.4 use eps = 0.1)

The tasks ask for the SUM over a batch's target tokens (reduction="sum") and count the targets
with `n_targets`: the training loop divides the summed losses of all micro-batches (and ranks) by
the global batch's number of targets, so each token weighs the same in the gradient whichever
micro-batch it fell in (masked LM and padded seq2seq batches hold different numbers of targets).

Shapes: B batch, T length, V vocab_size.
"""

from typing import Literal

import torch
from torch import Tensor

IGNORE_INDEX = -100


Reduction = Literal["mean", "sum"]


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """Label-smoothed cross-entropy over the targets that are not `ignore_index`.

    Args:
        logits: (..., V) unnormalised scores.  targets: (...) token ids.
        reduction: "mean" over the counted targets (0 when there are none), or their "sum".

    Returns:
        a scalar (fp32).
    """
    logp = torch.log_softmax(logits.float(), dim=-1).flatten(0, -2)  # (N, V), fp32
    targets = targets.flatten()  # (N,)
    keep = targets != ignore_index
    safe = targets.masked_fill(~keep, 0)
    nll = -logp.gather(1, safe[:, None]).squeeze(1)  # (N,)
    loss = (
        nll
        if label_smoothing == 0
        else (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    )
    total = (loss * keep).sum()
    return total if reduction == "sum" else total / keep.sum().clamp(min=1)


def n_targets(targets: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """How many of `targets` (any shape) count: those that are not `ignore_index`."""
    return int((targets != ignore_index).sum())


def clm_loss(logits: Tensor, y: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Causal LM: logits (B, T, V) for targets y (B, T), the inputs shifted by one."""
    return cross_entropy(logits, y, reduction=reduction)


def mlm_loss(logits: Tensor, labels: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Masked LM: logits (B, T, V); labels (B, T) with -100 where nothing was masked."""
    return cross_entropy(logits, labels, IGNORE_INDEX, reduction=reduction)


def seq2seq_loss(
    logits: Tensor,
    labels: Tensor,
    pad_id: int,
    label_smoothing: float = 0.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """Seq2seq: logits (B, T, V) for labels (B, T) padded with pad_id (ignored)."""
    return cross_entropy(logits, labels, pad_id, label_smoothing, reduction)
