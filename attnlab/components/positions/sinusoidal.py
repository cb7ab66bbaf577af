"""Fixed sinusoidal position encoding (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

Each position gets a d_model-vector of sines and cosines over geometrically spaced wavelengths,
from 2*pi up to base * 2*pi, interleaved as in the paper:

    PE(pos, 2i)     = sin(pos / base^(2i / d_model))
    PE(pos, 2i + 1) = cos(pos / base^(2i / d_model))

For any offset k, PE(pos + k) is a fixed linear function (a rotation per pair) of PE(pos), which
the paper hoped would let attention pick up relative positions. The table is added to the token
embeddings; scaling the embeddings by sqrt(d_model) and the dropout on the sum belong to the model.

Shapes: B batch, T sequence length, C d_model.
"""

import torch
from torch import Tensor

from attnlab.components.positions.base import PositionScheme


def sinusoidal_table(max_seq_len: int, d_model: int, base: float = 10000.0) -> Tensor:
    """The sinusoidal encoding of positions 0..max_seq_len-1 (Vaswani et al. 2017, §3.5).

    Args:
        max_seq_len: number of positions.
        d_model: C, the encoding width (an odd C ends with a sine column).
        base: the longest wavelength is base * 2*pi.

    Returns:
        (max_seq_len, C) float32 table, sin in even columns and cos in odd columns.
    """
    # float64 for the angles, so large positions keep their precision; stored as float32.
    pos = torch.arange(max_seq_len, dtype=torch.float64)[:, None]  # (max_seq_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(C/2),)
    angles = pos / base ** (two_i / d_model)  # (max_seq_len, ceil(C/2))
    table = torch.empty(max_seq_len, d_model, dtype=torch.float64)  # (max_seq_len, C)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles[:, : d_model // 2].cos()
    return table.float()


class SinusoidalPosition(PositionScheme):
    """Adds the fixed sinusoidal encoding to the token embeddings (Vaswani et al. 2017).

    Args:
        d_model: C, the embedding width.
        max_seq_len: number of positions in the table.
        base: wavelength base (10000 in the paper).
    """

    def __init__(self, d_model: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if d_model <= 0 or max_seq_len <= 0:
            raise ValueError(
                f"d_model and max_seq_len must be positive, got d_model={d_model}, "
                f"max_seq_len={max_seq_len}"
            )
        self.d_model, self.max_seq_len, self.base = d_model, max_seq_len, base
        self.max_positions = max_seq_len
        # A buffer so it follows .to(device); non-persistent because it is a pure function of
        # (max_seq_len, d_model, base): checkpoints stay smaller and never hold a stale copy.
        self.register_buffer(
            "table", sinusoidal_table(max_seq_len, d_model, base), persistent=False
        )

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Add the encoding of each position to its token embedding.

        Args:
            x: (B, T, C) token embeddings.
            pos: (T,) or (B, T) int64 positions, each in [0, max_seq_len).

        Returns:
            (B, T, C) x + PE(pos), in x's dtype.
        """
        bad = (pos < 0) | (pos >= self.max_seq_len)
        if bad.any():  # one host sync, at the model's input boundary
            raise ValueError(
                f"position {int(pos[bad][0])} is outside the sinusoidal table of "
                f"max_seq_len={self.max_seq_len} positions"
            )
        return x + self.table[pos].to(x.dtype)  # (T, C) or (B, T, C) broadcasts to (B, T, C)
