"""Perplexity of a decoder LM on a text: the held-out measure for models attnlab did not train.

The text is encoded once and cut into consecutive windows of at most `context` + 1 tokens that
overlap by one token, so every token after the first is predicted exactly once, from the
tokens before it in its window (as `transformers`' perplexity guide does with stride =
context). Perplexity is exp(the mean cross-entropy over those N - 1 predictions).

    ids  t0 t1 ... t_c | t_c ... t_2c | ...    window k: x = ids[kc : kc+c], y = ids[kc+1 : kc+c+1]
"""

import math
from pathlib import Path

import torch
from torch import nn

from attnlab.training.objectives import clm_loss


@torch.no_grad()
def token_perplexity(model: nn.Module, ids: list[int], context: int, device="cpu") -> dict:
    """The loss and perplexity of `model` on the token ids `ids`.

    Args:
        model: a decoder LM: (1, T) ids -> (1, T, V) logits.
        ids: the text's token ids (at least 2).
        context: the most tokens one forward reads.

    Returns:
        {"loss": mean nats per predicted token, "ppl": exp(loss), "tokens": predictions}.
    """
    if len(ids) < 2:
        raise ValueError(f"perplexity needs a text of at least 2 tokens, got {len(ids)}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = torch.tensor([ids[start : start + context + 1]], device=device)  # (1, T + 1)
        x, y = window[:, :-1], window[:, 1:]
        total += clm_loss(model(x).float(), y, reduction="sum").item()
        count += y.numel()
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def text_perplexity(
    model: nn.Module, tokenizer, path: str | Path, context: int, device="cpu"
) -> dict:
    """`token_perplexity` of the UTF-8 text file at `path`, encoded by `tokenizer`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--text {str(path)!r} is not a file: give a UTF-8 text file to score")
    return token_perplexity(
        model, tokenizer.encode(path.read_text(encoding="utf-8")), context, device
    )
