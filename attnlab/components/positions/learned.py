"""Learned absolute position embedding (GPT-2, BERT).

One trained vector per position, added to the token embeddings, as in GPT-1/2 and BERT.
Vaswani et al. (2017, §3.5) found it performed about the same as the fixed sinusoids, but it
cannot go past the positions it was trained on: a longer input is an error, not a guess.

Shapes: B batch, T sequence length, C d_model.
"""

import torch
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint
from attnlab.components.positions.base import PositionScheme


class LearnedPosition(PositionScheme):
    """Adds a trained embedding of each position to the token embeddings.

    Args:
        max_seq_len: number of positions with an embedding (GPT-2: 1024, BERT: 512).
        d_model: C, the embedding width.
    """

    def __init__(self, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        if max_seq_len <= 0 or d_model <= 0:
            raise ValueError(
                f"max_seq_len and d_model must be positive, got max_seq_len={max_seq_len}, "
                f"d_model={d_model}"
            )
        self.max_seq_len = self.max_positions = max_seq_len
        self.table = nn.Embedding(max_seq_len, d_model)  # weight: (max_seq_len, C)
        self.hook_pos, self.hook_pos_embed = HookPoint(), HookPoint()  # components/hooks.py

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Add the learned embedding of each position to its token embedding.

        Args:
            x: (B, T, C) token embeddings.
            pos: (T,) or (B, T) int64 positions, each in [0, max_seq_len).

        Returns:
            (B, T, C) x + table(pos).
        """
        if not torch.compiler.is_compiling():  # the check syncs with the host: eager only
            bad = (pos < 0) | (pos >= self.max_seq_len)
            if bad.any():  # one host sync, at the model's input boundary
                raise ValueError(
                    f"position {int(pos[bad][0])} is beyond the learned position table of "
                    f"{self.max_seq_len} positions (valid: 0..{self.max_seq_len - 1})"
                )
        embedded = self.table(self.hook_pos(pos)).expand_as(x)  # (B, T, C), a view
        return x + self.hook_pos_embed(embedded)  # (B, T, C)
