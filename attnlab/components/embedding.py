"""Token embedding (with optional sqrt(d_model) scaling) and the output head it can be tied to.

Vaswani et al. 2017 §3.4 multiply the embedding by sqrt(d_model) and share one matrix between the
input embedding and the pre-softmax projection ("weight tying", Press & Wolf 2017). BLOOM
normalises the token vectors right away (`word_embeddings_layernorm`): `TokenEmbedding` with a norm.

Shapes: B batch, T length, C d_model, V vocab_size.
"""

import math

import torch
from torch import Tensor, nn


class TokenEmbedding(nn.Embedding):
    """Token ids -> vectors, checking ids against the vocabulary.

    Args:
        vocab_size: V.  d_model: C.  scale: multiply by sqrt(C) (2017 paper).
        norm: normalise the vectors after the lookup (BLOOM's word_embeddings_layernorm), or None.
    """

    def __init__(
        self, vocab_size: int, d_model: int, scale: bool = False, norm: nn.Module | None = None
    ):
        super().__init__(vocab_size, d_model)
        self.multiplier = math.sqrt(d_model) if scale else 1.0
        self.norm = nn.Identity() if norm is None else norm  # Identity holds no weights

    def reset_parameters(self) -> None:
        """torch's N(0, 1), except on the meta device (a model built to load weights into, which
        init_weights leaves alone): there torch's normal_ imports torch._dynamo, 2 s of a load."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids: Tensor) -> Tensor:
        """ids: (B, T) int64 in [0, V) -> (B, T, C)."""
        if not torch.compiler.is_compiling():  # the check syncs with the host: eager only
            check_token_ids(ids, self.num_embeddings)
        x = super().forward(ids)  # (B, T, C)
        if self.multiplier != 1.0:  # the scale rounded to the weights' dtype first, as Gemma's
            x = x * torch.tensor(self.multiplier, dtype=x.dtype)  # code does: 55.43 -> 55.5 in bf16
        return self.norm(x)  # (B, T, C)


def check_token_ids(ids: Tensor, vocab_size: int) -> None:
    """ValueError naming the first id outside [0, vocab_size) (a host sync: boundaries only)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token ids must be int32/int64, got {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if ids.numel() and bool(bad.any()):
        value = int(ids[bad][0])
        raise ValueError(f"token id {value} is outside the vocabulary [0, {vocab_size})")


def tie_weights(head: nn.Linear, embedding: nn.Embedding) -> None:
    """Share one (V, C) matrix between the input embedding and the output head."""
    head.weight = embedding.weight
