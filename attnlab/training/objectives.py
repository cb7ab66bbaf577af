"""Training objectives, written out: causal LM, masked LM, and seq2seq with label smoothing.

All three are the same cross-entropy, -log p(target), averaged over the positions that count:
    CLM      every position predicts the next token           (Radford et al. 2018)
    MLM      only the masked positions (labels != -100)       (Devlin et al. 2019)
    seq2seq  every non-padding target token, with label smoothing eps: the target distribution is
             (1 - eps) on the right token plus eps spread uniformly over the vocabulary
             (Szegedy et al. 2016; Vaswani et al. 2017 §5.4 use eps = 0.1)

Shapes: B batch, T length, V vocab_size.
"""

import torch
from torch import Tensor

IGNORE_INDEX = -100


def cross_entropy(
    logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0
) -> Tensor:
    """Mean label-smoothed cross-entropy over the targets that are not `ignore_index`.

    Args:
        logits: (..., V) unnormalised scores.  targets: (...) token ids.

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
    return (loss * keep).sum() / keep.sum().clamp(min=1)


def clm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Causal LM: logits (B, T, V) for targets y (B, T), the inputs shifted by one."""
    return cross_entropy(logits, y)


def mlm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Masked LM: logits (B, T, V); labels (B, T) with -100 where nothing was masked."""
    return cross_entropy(logits, labels, IGNORE_INDEX)


def seq2seq_loss(
    logits: Tensor, labels: Tensor, pad_id: int, label_smoothing: float = 0.0
) -> Tensor:
    """Seq2seq: logits (B, T, V) for labels (B, T) padded with pad_id (ignored)."""
    return cross_entropy(logits, labels, pad_id, label_smoothing)
