"""Fine-tuning objectives, written out: supervised fine-tuning (SFT) and DPO.

SFT (instruction tuning, Ouyang et al. 2022 §3.5; Wei et al. 2022): the causal-LM cross-entropy,
counted on the response tokens only. A sequence is prompt + response; the output at position t
predicts token t+1, so the labels are the inputs shifted by one with every label that is still a
prompt token (and every padding position) set to the ignore index:

    ids      p0 p1 p2 r0 r1 <eos>
    x        p0 p1 p2 r0 r1            (the model's input)
    labels   -- -- r0 r1 <eos>         (-- = IGNORE_INDEX)

The loss is token-weighted: the sum over a batch's response tokens divided by their number, so
a long response weighs more than a short one (as `transformers` computes it with -100 labels).

DPO (Rafailov et al. 2023, eq. 7): for a prompt x with a preferred response y_w ("chosen") and
a dispreferred one y_l ("rejected"),

    L = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])

where log pi(y|x) is the sum of the policy's token log-probs over the response tokens, and
`ref` is a frozen reference model: a copy of the model before DPO, or (when the policy is the
base plus LoRA adapters) the same model with its adapters switched off, as `peft` users do. The
implicit rewards r(x, y) = beta * (log pi(y|x) - log ref(y|x)) (§5) are returned with the loss:
their margin r_w - r_l and how often r_w > r_l are the preference metrics. RPO (Pang et al.
2024) adds alpha times the chosen responses' SFT loss (`pair_losses`). IPO, conservative DPO
(label smoothing) and robust DPO change the loss of the same margin (`dpo_loss`).

Shapes: B batch (of sequences; of pairs for DPO), T length, V vocab_size.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# IGNORE_INDEX: the label of a position that is not trained on (prompt, padding), -100 as in
# `transformers` and `torch.nn.functional.cross_entropy`.
from attnlab.adapters.lora import disable_adapters, lora_modules
from attnlab.training.objectives import IGNORE_INDEX

Reduction = Literal["mean", "sum"]


def response_labels(ids: list[int], n_prompt: int) -> tuple[list[int], list[int]]:
    """Input and labels of one prompt + response sequence, the prompt's labels ignored.

    Args:
        ids: the whole sequence, prompt tokens first (n_prompt of them), then the response.
        n_prompt: how many of `ids` belong to the prompt (>= 1).

    Returns:
        x: ids[:-1], the model's input.  labels: ids[1:] with the labels of positions whose
        next token is still part of the prompt set to IGNORE_INDEX; both of length len(ids) - 1.
    """
    if not 1 <= n_prompt < len(ids):
        raise ValueError(
            f"a sequence of {len(ids)} tokens with a prompt of {n_prompt} has no response token"
        )
    x, labels = ids[:-1], list(ids[1:])
    for t in range(n_prompt - 1):  # labels[t] = ids[t + 1], a prompt token while t + 1 < n_prompt
        labels[t] = IGNORE_INDEX
    return x, labels


def token_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) at every position; 0 where the label is IGNORE_INDEX.

    Args:
        logits: (B, T, V) next-token scores.  labels: (B, T) token ids or IGNORE_INDEX.

    Returns:
        (B, T) fp32 log-probabilities.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V), fp32
    keep = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.masked_fill(~keep, 0)[..., None]).squeeze(-1)  # (B, T)
    return picked * keep


def sft_loss(logits: Tensor, labels: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Next-token cross-entropy on the response tokens only (labels != IGNORE_INDEX).

    Args:
        logits: (B, T, V).  labels: (B, T) from `response_labels`, padded with IGNORE_INDEX.
        reduction: "mean" over the response tokens (token-weighted; 0 when there are none) or
            their "sum" (the training loop divides by the global batch's count).

    Returns:
        a scalar (fp32).
    """
    total = -token_logps(logits, labels).sum()
    if reduction == "sum":
        return total
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def sequence_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """log pi(y|x): the sum of the response tokens' log-probs of each sequence.

    Args:
        logits: (B, T, V).  labels: (B, T), IGNORE_INDEX on the prompt and padding.

    Returns:
        (B,) fp32.
    """
    return token_logps(logits, labels).sum(-1)


DPOLoss = Literal["sigmoid", "ipo", "robust"]
DPO_LOSSES = ("sigmoid", "ipo", "robust")


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    loss: DPOLoss = "sigmoid",
    label_smoothing: float = 0.0,
    lengths: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The preference loss of each pair and the implicit rewards. With h = the chosen log-ratio
    minus the rejected one, (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)):

    sigmoid  DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta h). With label_smoothing
             eps > 0, conservative DPO (cDPO, Mitchell 2023): the label is taken to be flipped
             with probability eps, -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),
             whose optimum is a finite margin instead of an unbounded one.
    ipo      IPO (Azar et al. 2023, eq. 17): (h' - 1 / (2 beta))^2, a squared loss that pulls
             the margin to 1 / (2 beta) rather than to infinity, with beta the paper's tau.
             h' is h with each log-ratio divided by its response's token count (`lengths`),
             as trl computes it (the form the paper's results used, say its authors).
    robust   robust DPO (Chowdhury et al. 2024): an unbiased loss under labels flipped with
             probability eps, (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) /
             (1 - 2 eps).

    Args:
        policy_chosen, policy_rejected: (B,) log pi(y_w|x) and log pi(y_l|x) (`sequence_logps`).
        ref_chosen, ref_rejected: (B,) the same under the frozen reference (no gradient).
        beta: how far the policy may move from the reference (the KL penalty's weight).
        loss: "sigmoid", "ipo" or "robust" (trl's loss_type of the same name).
        label_smoothing: eps, for sigmoid (cDPO) and robust.
        lengths: (chosen, rejected) response token counts, each (B,); ipo needs them.

    Returns:
        losses: (B,).
        chosen_rewards, rejected_rewards: (B,) beta * (log pi - log ref), detached.
    """
    chosen_ratio = policy_chosen - ref_chosen  # (B,) log pi(y_w|x) / ref(y_w|x)
    rejected_ratio = policy_rejected - ref_rejected  # (B,)
    eps = label_smoothing
    z = beta * (chosen_ratio - rejected_ratio)  # (B,)
    if loss == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss == "robust":
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    elif loss == "ipo":
        if lengths is None:
            raise ValueError("the IPO loss needs the responses' token counts (lengths)")
        n_chosen, n_rejected = (n.clamp(min=1) for n in lengths)
        margin = chosen_ratio / n_chosen - rejected_ratio / n_rejected  # (B,)
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"DPO loss must be one of {list(DPO_LOSSES)}, got {loss!r}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def chosen_nll(token_logps: Tensor, labels: Tensor) -> Tensor:
    """RPO's extra term: the negative log-likelihood per token of the chosen responses.

    Args:
        token_logps: (b, T) the policy's `token_logps` of the chosen sequences.
        labels: (b, T) their labels (IGNORE_INDEX off the response).

    Returns:
        a scalar: minus the mean log-prob over all the batch's chosen response tokens (as SFT's
        token-weighted loss; trl's "sft" loss type).
    """
    return -token_logps.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)


def pair_losses(
    token_logps: Tensor,
    labels: Tensor,
    ref_logps: Tensor,
    beta: float = 0.1,
    rpo_alpha: float = 0.0,
    loss: DPOLoss = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loss of each pair of a DPO batch, with RPO's NLL term when rpo_alpha > 0.

    RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1): DPO plus
    alpha times the chosen responses' NLL, which keeps the chosen responses likely while DPO
    pushes the two apart (DPO alone may lower both). trl: loss_type ["sigmoid", "sft"] with
    loss_weights [1, alpha]; as there, the NLL is one number per batch, added to every pair.

    Args:
        token_logps: (2b, T) the policy's `token_logps`: the b chosen sequences, then the b
            rejected ones.
        labels: (2b, T) their labels.
        ref_logps: (2b,) the reference's sequence log-probs, in the same order.
        beta: DPO's beta.  rpo_alpha: the NLL term's weight (0: plain DPO).
        loss, label_smoothing: `dpo_loss`'s (sigmoid, ipo or robust; eps).

    Returns:
        losses (b,), chosen_rewards (b,), rejected_rewards (b,) as `dpo_loss`.
    """
    b = token_logps.shape[0] // 2
    logps = token_logps.sum(-1)  # (2b,) log pi(y|x)
    n = (labels != IGNORE_INDEX).sum(-1)  # (2b,) response tokens
    policy, ref, lengths = (logps[:b], logps[b:]), (ref_logps[:b], ref_logps[b:]), (n[:b], n[b:])
    losses, chosen, rejected = dpo_loss(*policy, *ref, beta, loss, label_smoothing, lengths)
    if rpo_alpha:
        losses = losses + rpo_alpha * chosen_nll(token_logps[:b], labels[:b])
    return losses, chosen, rejected


@contextmanager
def reference_model(policy: nn.Module, frozen: nn.Module | None = None) -> Iterator[nn.Module]:
    """The model whose log-probs are DPO's reference, for the length of a `with` block.

    Args:
        policy: the model being trained (or its DDP wrapper).
        frozen: a frozen copy of the model before DPO; None to use the policy itself with its
            LoRA adapters switched off (`lora.disable_adapters`).

    Yields:
        `frozen`, or `policy` while its adapters are off (they are back on after the block).
    """
    if frozen is not None:
        yield frozen
        return
    net = getattr(policy, "module", policy)  # DDP keeps the model as .module
    if not lora_modules(net):
        raise ValueError(
            "DPO needs a reference model: pass a frozen copy of the base model, or train LoRA "
            "adapters (--lora.rank 8) so that the base with its adapters off is the reference"
        )
    with disable_adapters(net):
        yield policy
