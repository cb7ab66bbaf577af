"""What a head attends to, and what each layer already predicts: scores for attention maps and
residual streams (the experiment that runs them on a checkpoint is lab/heads.py).

    offset_score(probs, k)        attention from each token to the one k back (0: itself,
                                  1: the previous token)
    first_token_score(probs)      attention to the first token
    induction_score(probs)        Olsson et al. 2022: on [r, r], attention from the second copy to
                                  the token after the first occurrence
    logit_lens(model, x, y)       the final norm and LM head on each layer's residual stream
                                  (nostalgebraist 2020, "interpreting GPT: the logit lens")

Shapes: L layers, H heads, B batch, T length, S keys, V vocab.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.viz.capture import capture_attention

Batch = tuple[Tensor, Tensor]  # (B, T) inputs, (B, T) next-token targets


def token_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of logits (B, T, V) against targets (B, T), in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


# --- attention patterns --------------------------------------------------------------------------
def offset_score(probs: Tensor, offset: int) -> Tensor:
    """Mean attention from each query i to key i - offset (queries with i >= offset).

    Args:
        probs: (B, H, T, S) attention probabilities, queries the last T of S keys (S = T here).
        offset: 0 = the same position, 1 = the previous token, k = k tokens back.

    Returns:
        (H,) scores in [0, 1].
    """
    T = probs.shape[2]
    if not 0 <= offset < T:
        raise ValueError(f"offset {offset} needs a sequence longer than {T} tokens")
    diag = probs.diagonal(offset=-offset, dim1=2, dim2=3)  # (B, H, T - offset): A[i, i - offset]
    return diag.mean(dim=(0, 2))


def first_token_score(probs: Tensor) -> Tensor:
    """(H,) mean attention from queries 1..T-1 to key 0 (query 0 can only attend to itself)."""
    return probs[:, :, 1:, 0].mean(dim=(0, 2))


def induction_score(probs: Tensor) -> Tensor:
    """Olsson et al. 2022 on a repeated sequence [r, r] of 2n tokens: the mean attention from
    each token of the second copy (position n + j) to the token after its first occurrence (j + 1).

    Args:
        probs: (B, H, 2n, 2n) attention probabilities on [r, r].

    Returns:
        (H,) scores in [0, 1].
    """
    n = probs.shape[2] // 2
    j = torch.arange(n)
    return probs[:, :, n + j, j + 1].mean(dim=(0, 2))


def induction_chance(n: int) -> float:
    """The induction score of uniform causal attention on [r, r]: mean of 1 / (n + j + 1)."""
    return sum(1 / (n + j + 1) for j in range(n)) / n


def repeated_tokens(vocab_size: int, n: int, batch: int, seed: int) -> Tensor:
    """(batch, 2n) ids [r, r]: r is n distinct tokens drawn uniformly (seeded).

    Distinct, so every token of the second copy has exactly one earlier occurrence: with a small
    vocabulary (characters) repeats inside r would split an induction head's attention between
    several "tokens after" and lower its score for a reason that is not the head's.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"repeat length n={n} must be in 1..vocab_size={vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(batch, vocab_size, generator=gen).argsort(dim=1)[:, :n]  # (B, n) distinct
    return torch.cat([r, r], dim=1)  # (B, 2n)


@torch.no_grad()
def layer_probs(model: nn.Module, ids: Tensor) -> list[Tensor]:
    """Each layer's self-attention probabilities on `ids` (B, T): L tensors of (B, H, T, T)."""
    with capture_attention(model, kinds=["decoder_self"]) as maps:
        model(ids)
    return [maps["decoder_self"][i] for i in range(len(maps["decoder_self"]))]


def pattern_scores(probs: list[Tensor], offsets: Sequence[int] = (2,)) -> dict[str, Tensor]:
    """Positional scores of every head, each (L, H).

    Args:
        probs: per layer (B, H, T, T), e.g. from `layer_probs` on ordinary text.
        offsets: the fixed offsets k scored besides 0 (same position) and 1 (previous token).

    Returns:
        {"previous_token", "same_position", "first_token", "offset_k" for each k}.
    """
    scores = {
        "previous_token": torch.stack([offset_score(p, 1) for p in probs]),
        "same_position": torch.stack([offset_score(p, 0) for p in probs]),
        "first_token": torch.stack([first_token_score(p) for p in probs]),
    }
    for k in offsets:
        scores[f"offset_{k}"] = torch.stack([offset_score(p, k) for p in probs])
    return scores


def induction_scores(model: nn.Module, vocab_size: int, n: int, batch: int, seed: int) -> Tensor:
    """(L, H) induction scores on `batch` seeded repeated random sequences of 2n tokens."""
    ids = repeated_tokens(vocab_size, n, batch, seed)  # (B, 2n)
    return torch.stack([induction_score(p) for p in layer_probs(model, ids)])


# --- logit lens ----------------------------------------------------------------------------------
@torch.no_grad()
def logit_lens(model: nn.Module, x: Tensor, y: Tensor) -> list[dict]:
    """The final norm and LM head applied to the residual stream after the embedding and after
    each block (nostalgebraist 2020, "interpreting GPT: the logit lens").

    Args:
        x: (B, T) ids.  y: (B, T) next-token targets.

    Returns:
        One row per stream ("embedding", "block 0", ...): its loss on y and "agreement", the
        fraction of positions whose top-1 token equals the full model's.
    """
    streams: list[Tensor] = []
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, args: streams.append(args[0]))]
    hooks += [b.register_forward_hook(lambda m, a, out: streams.append(out)) for b in model.blocks]
    try:
        final = model(x).argmax(-1)  # (B, T)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i, h in enumerate(streams):
        logits = model.logits(h)  # (B, T, V)
        rows.append(
            {
                "stream": "embedding" if i == 0 else f"block {i - 1}",
                "loss": token_loss(logits, y).item(),
                "agreement": (logits.argmax(-1) == final).float().mean().item(),
            }
        )
    return rows


def mean_logit_lens(model: nn.Module, batches: Sequence[Batch]) -> list[dict]:
    """`logit_lens` averaged over batches (each row's loss and agreement)."""
    per_batch = [logit_lens(model, x, y) for x, y in batches]
    return [
        {
            "stream": rows[0]["stream"],
            "loss": sum(r["loss"] for r in rows) / len(rows),
            "agreement": sum(r["agreement"] for r in rows) / len(rows),
        }
        for rows in zip(*per_batch)
    ]
