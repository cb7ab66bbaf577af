"""Shared by the interop tests: padded batches and logits comparisons (no transformers here)."""

import torch
from torch import Tensor

VOCAB = 128
ATOL = 1e-4  # fp32 parity tolerance on logits and hidden states
TINY_LLAMA = dict(  # transformers LlamaConfig fields: 2 layers, GQA (4 heads / 2 kv), wide init
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def padded_batch(
    B: int = 3,
    T: int = 12,
    vocab: int = VOCAB,
    seed: int = 0,
    lengths: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor]:
    """Random ids, right-padded: row lengths T, T - 4, 5 (... ), mask True = real token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    lengths = lengths or tuple([T, T - 4, 5, T - 1][:B])
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    return ids.masked_fill(~mask, 0), mask


def max_diff(a: Tensor, b: Tensor, mask: Tensor | None = None) -> float:
    """Max abs difference, at real positions only when a (B, T) mask is given."""
    d = (a.float() - b.float()).abs()
    return float(d[mask].max() if mask is not None else d.max())


def same_state(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
