"""Token-by-token generation for decoder-only and encoder-decoder models.

Shapes: B batch, T prompt length, N new tokens, V vocab_size.
"""

import torch
from torch import Tensor, nn


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Sample continuations of a decoder-only model, recomputing the whole prefix each step.

    Args:
        ids: (B, T) prompt.  temperature: 0 -> greedy.  top_k: keep the k most likely tokens.
        max_seq_len: crop the context to its last `max_seq_len` tokens (learned positions).

    Returns:
        (B, T + N) the prompt followed by the new tokens.
    """
    for _ in range(max_new_tokens):
        context = ids if max_seq_len is None else ids[:, -max_seq_len:]
        logits = model(context)[:, -1].float()  # (B, V)
        ids = torch.cat([ids, _choose(logits, temperature, top_k, generator)], dim=1)
    return ids


@torch.no_grad()
def greedy_seq2seq(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
) -> Tensor:
    """Greedy decoding of an EncoderDecoder: encode once, then extend the target token by token.

    Returns:
        (B, 1 + N) target ids starting with bos_id; rows that emitted eos_id keep emitting it.
    """
    memory = model.encode(src, src_mask)  # (B, M, C)
    tgt = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(max_new_tokens):
        next_id = model.decode(tgt, memory, src_mask)[:, -1].argmax(-1)  # (B,)
        next_id = next_id.masked_fill(done, eos_id)
        tgt = torch.cat([tgt, next_id[:, None]], dim=1)
        done |= next_id == eos_id
        if bool(done.all()):
            break
    return tgt


def _choose(logits: Tensor, temperature: float, top_k: int | None, generator) -> Tensor:
    """(B, V) logits -> (B, 1) token ids."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
