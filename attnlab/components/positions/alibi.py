"""Attention with Linear Biases, ALiBi (Press et al. 2022, "Train Short, Test Long",
arXiv:2108.12409).

No position vectors at all: each head h penalises a key by its distance from the query,

    score(i, j) += -m_h * |j - i|

with fixed head slopes m_h forming a geometric sequence (8 heads: 1/2, 1/4, ..., 1/256). Heads
with small slopes see far back, heads with large slopes stay local, and the bias extrapolates
to lengths never seen in training. The paper is causal (j <= i, so |j - i| = i - j); the absolute
value is the usual symmetric extension for encoders.

A float score bias moves SDPA off its flash kernel (onto the memory-efficient or math kernel);
the flex backend takes the same bias as a `score_mod` closed over the H slopes alone.

Shapes: B batch, H heads, T query length, S key length.
"""

import math

import torch
from torch import Tensor

from attnlab.components.positions.base import PositionScheme, ScoreMod, position_reader


def _power_of_two_slopes(n: int) -> list[float]:
    # Geometric sequence starting at 2^(-8/n) with that same ratio: 2^(-8/n), 2^(-16/n), ...
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))  # = 2^(-8/n), written as in the reference code
    return [start * start**i for i in range(n)]


def alibi_slopes(n_heads: int) -> Tensor:
    """The per-head slopes m_h, as in the paper's reference code (and Bloom).

    For a power of two n the slopes are 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise take the
    n' = largest power of two below n, then fill the remaining n - n' heads with every other
    slope of the 2n' sequence (the ones that fall between the first n' slopes).

    Args:
        n_heads: H, number of attention heads.

    Returns:
        (H,) float32 slopes.
    """
    if n_heads <= 0:
        raise ValueError(f"ALiBi needs n_heads >= 1, got n_heads={n_heads}")
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = _power_of_two_slopes(closest)
    if closest != n_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)  # (H,)


class ALiBi(PositionScheme):
    """Linear distance penalties on the attention scores (Press et al. 2022).

    Args:
        n_heads: H, number of query heads.
    """

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        # Non-persistent: a pure function of n_heads, so it has no place in checkpoints.
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)  # (H,)

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """-m_h * |k_pos - q_pos| for every head, query and key.

        Args:
            q_pos: (T,) or (B, T) query positions.
            k_pos: (S,) or (B, S) key positions.

        Returns:
            (H, T, S) for 1-D positions or (B, H, T, S) for 2-D, float32.
        """
        distance = (k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)).abs()  # (T, S) or (B, T, S)
        distance = distance.unsqueeze(-3).float()  # (1, T, S) or (B, 1, T, S)
        return -self.slopes.float()[:, None, None] * distance  # (H, T, S) or (B, H, T, S)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, bound: int | None = None) -> ScoreMod:
        """`score_bias` as a score_mod: score - m_h * |k_pos[j] - q_pos[i]|, nothing (T, S) built.

        Args:
            q_pos: (T,) or (B, T) query positions.
            k_pos: (S,) or (B, S) key positions.
            bound: unused (the slopes do not depend on the length).

        Returns:
            (score, b, h, i, j) -> score.
        """
        slopes = self.slopes.float()  # (H,)
        q_at, k_at = position_reader(q_pos), position_reader(k_pos)

        def alibi(score, b, h, i, j):
            distance = (k_at(b, j) - q_at(b, i)).abs()
            return score - (slopes[h] * distance).to(score.dtype)

        alibi.tensors = (slopes,)  # what it reads (fixed here; see base.py)
        alibi.additive = True  # score + a bias: dS passes back unchanged (components/flash.py)
        return alibi
