"""Checking that the heads the induction score finds are induction heads: ablation and patching.

    repeat_logprob(logits, ids)         mean log-probability of the second copy of [r, r]
    corrupt_first_copy(ids, vocab, seed)   [r', r]: the first copy replaced by fresh tokens
    ablation_check(model, ids, heads, n_random, seed)   the second copy's loss with `heads`
                                        masked, beside as many heads drawn at random
    patching_check(model, ids, vocab, heads, seed)      per-head patching from [r, r] into
                                        [r', r], and `heads` patched together
    induction_check(model, ids, vocab, scores, k, n_random, seed)   both, for the top k heads

An induction head (Olsson et al. 2022, "In-context Learning and Induction Heads") attends from
a token A to the token B that followed A's earlier occurrence, and copies B. On random tokens
repeated once, [r, r], that is the only way to predict the second copy, so the top heads by
`head_scores.induction_score` can be tested two ways:

- ablation: masking them (zero, `heads.set_head_mask`) should raise the loss on the second copy
  far more than masking as many heads drawn at random;
- patching (denoising, lab/patching.py): in [r', r] nothing earlier predicts the second copy;
  patching one head's output (hook_z, every position) from the clean run [r, r] brings back
  part of the clean run's log-probability of it, `normalised` to 0 (as in [r', r]) .. 1 (as
  in [r, r]). The heads that bring back the most should be the top heads by score.

The second copy's tokens are scored from its second token on (position n + j predicts r[j+1],
the queries the induction score reads); its first token cannot be predicted in either run.

Shapes: B batch, n repeat length, T = 2n, L layers, H heads, V vocab.
"""

import torch
from torch import Tensor, nn

from attnlab.components.hooks import run_with_cache
from attnlab.lab.head_masks import head_shape, set_head_mask
from attnlab.lab.head_scores import repeated_tokens
from attnlab.lab.patching import normalised, patch, patch_heads, patch_names

Head = tuple[int, int]  # (layer, head)


def repeat_logprob(logits: Tensor, ids: Tensor) -> Tensor:
    """Mean log-probability of the second copy's tokens 2..n given what precedes them.

    Args:
        logits: (B, 2n, V).  ids: (B, 2n), [r, r] or [r', r].

    Returns:
        A scalar tensor (the repeat loss is its negative).
    """
    n = ids.shape[1] // 2
    logp = logits[:, n:-1].float().log_softmax(-1)  # (B, n - 1, V)
    return logp.gather(-1, ids[:, n + 1 :, None]).mean()


def corrupt_first_copy(ids: Tensor, vocab_size: int, seed: int) -> Tensor:
    """[r', r]: the first copy of each row of [r, r] replaced by n fresh distinct tokens (seeded;
    with a small vocabulary some may happen to occur in r)."""
    n = ids.shape[1] // 2
    fresh = repeated_tokens(vocab_size, n, ids.shape[0], seed + 1)[:, :n]  # (B, n)
    return torch.cat([fresh, ids[:, n:]], dim=1)


def top_heads(scores: Tensor, k: int) -> list[Head]:
    """The k (layer, head) pairs of highest score in (L, H) `scores`, best first."""
    H = scores.shape[1]
    return [(i // H, i % H) for i in scores.flatten().argsort(descending=True)[:k].tolist()]


@torch.no_grad()
def ablation_check(
    model: nn.Module, ids: Tensor, heads: list[Head], n_random: int, seed: int
) -> dict:
    """The loss on the second copy of [r, r]: as is, with `heads` masked, and with as many heads
    masked at random (`n_random` seeded draws among the other heads).

    Returns:
        {"loss", "ablated": with `heads` masked, "random": [one per draw], "random_heads"}.
    """
    L, H = head_shape(model)
    chosen = {layer * H + h for layer, h in heads}
    others = torch.tensor([i for i in range(L * H) if i not in chosen])
    gen = torch.Generator().manual_seed(seed)
    draws = [
        others[torch.randperm(len(others), generator=gen)[: len(heads)]] for _ in range(n_random)
    ]

    def loss(masked) -> float:
        mask = torch.ones(L * H)
        mask[list(masked)] = 0.0
        set_head_mask(model, mask.view(L, H))
        try:
            return -repeat_logprob(model(ids), ids).item()
        finally:
            set_head_mask(model, None)

    return {
        "loss": loss([]),
        "ablated": loss(chosen),
        "random": [loss(d.tolist()) for d in draws],
        "random_heads": [[(i // H, i % H) for i in d.tolist()] for d in draws],
    }


@torch.no_grad()
def patching_check(
    model: nn.Module, ids: Tensor, vocab_size: int, heads: list[Head], seed: int
) -> dict:
    """Patching from [r, r] into [r', r] (`corrupt_first_copy`), normalised: 0 = corrupted,
    1 = clean log-probability of the second copy.

    Returns:
        {"clean", "corrupt": the two runs' repeat_logprob, "per_head": (L, H) each head alone,
        "together": `heads` patched at once, "best_together": as many heads of highest
        per-head value patched at once, "best_heads": those heads}.
    """
    corrupt = corrupt_first_copy(ids, vocab_size, seed)
    clean_logits, cache = run_with_cache(model, ids, names=patch_names(model, "head"))
    c = repeat_logprob(clean_logits, ids).item()
    k = repeat_logprob(model(corrupt), corrupt).item()

    def restored(logits: Tensor) -> Tensor:
        return normalised(repeat_logprob(logits, corrupt), c, k)

    per_head = patch(model, corrupt, cache, restored, "head")  # (L, H)
    best = top_heads(per_head, len(heads))
    return {
        "clean": c,
        "corrupt": k,
        "per_head": per_head,
        "together": restored(patch_heads(model, corrupt, cache, heads)).item(),
        "best_together": restored(patch_heads(model, corrupt, cache, best)).item(),
        "best_heads": best,
    }


def induction_check(
    model: nn.Module,
    vocab_size: int,
    n: int,
    batch: int,
    scores: Tensor,
    k: int,
    seed: int,
    n_random: int = 5,
) -> dict:
    """The ablation and patching checks of the top k heads by induction score, on the seeded
    [r, r] batch `head_scores.induction_scores` scores (same vocab_size, n, batch and seed).

    Returns:
        {"heads": the top k, "ablation": ablation_check's dict, "patching": patching_check's
        dict (per_head as a list)}.
    """
    ids = repeated_tokens(vocab_size, n, batch, seed)  # (B, 2n)
    heads = top_heads(scores, k)
    patching = patching_check(model, ids, vocab_size, heads, seed)
    return {
        "heads": heads,
        "ablation": ablation_check(model, ids, heads, n_random, seed),
        "patching": patching | {"per_head": patching["per_head"].tolist()},
    }
