"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning",
§2.1; after Shaw et al. 2018).

Each head learns one scalar per *bucket* of relative position j - i, added to the scores.
Small distances get a bucket each; larger ones share log-spaced buckets up to max_distance,
beyond which everything shares the last bucket. Bidirectional (encoder) attention splits the
buckets between keys before and after the query; causal (decoder) attention only looks back.

    bidirectional, 32 buckets, max_distance 128 (each half: 16 buckets):
      j - i <= 0:  |j - i| = 0..7 -> buckets 0..7,  8..127 -> 8..15 (log), >= 128 -> 15
      j - i  > 0:  the same, shifted by 16

T5 shares one bias table across layers (only the first layer owns it). A float score bias moves
SDPA off its flash kernel; the flex backend takes it as a `score_mod` that reads a bias per
relative distance, (2 * bound - 1, H) numbers instead of (H, T, S).

Shapes: B batch, H heads, T query length, S key length.
"""

import math

import torch
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint
from attnlab.components.positions.base import PositionScheme, ScoreMod, position_reader


def relative_position_bucket(
    relative_position: Tensor,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:
    """Map relative positions j - i to bucket ids (Raffel et al. 2020; Mesh TensorFlow).

    Args:
        relative_position: any-shape int tensor of key position - query position.
        bidirectional: if True, half the buckets are for keys after the query; if False,
            keys after the query (j - i > 0) all land in bucket 0 (a causal mask hides them).
        num_buckets: total number of buckets.
        max_distance: distances at or beyond this share the last bucket.

    Returns:
        int64 tensor of bucket ids in [0, num_buckets), same shape as relative_position.
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets  # keys ahead: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only looking back counts
    max_exact = num_buckets // 2
    # Log-spaced buckets: distance max_exact -> bucket max_exact, max_distance -> num_buckets.
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(
        max_distance / max_exact
    )
    log_bucket = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    log_bucket = log_bucket.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, log_bucket)


class T5Bias(PositionScheme):
    """Learned per-head bias for each bucket of relative position (Raffel et al. 2020).

    Args:
        n_heads: H, number of attention heads.
        num_buckets: number of relative-position buckets.
        max_distance: distances at or beyond this share the last bucket.
        bidirectional: True for encoder self-attention, False for decoder self-attention.
    """

    def __init__(
        self,
        n_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        min_buckets = 4 if bidirectional else 2  # so max_exact = (half of) num_buckets // 2 >= 1
        if n_heads <= 0 or num_buckets < min_buckets:
            raise ValueError(
                f"T5Bias needs n_heads >= 1 and num_buckets >= {min_buckets}, got "
                f"n_heads={n_heads}, num_buckets={num_buckets}"
            )
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if max_distance <= exact:
            raise ValueError(
                f"max_distance={max_distance} must exceed the {exact} exact buckets"
                f" (num_buckets={num_buckets}, bidirectional={bidirectional})"
            )
        self.n_heads, self.num_buckets = n_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)  # name as in HF T5
        # The buckets and the learned bias, on the dense path (a flex score_mod reads the table).
        self.hook_buckets, self.hook_pos_embed = HookPoint(), HookPoint()

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The learned bias for each head at bucket(k_pos - q_pos).

        Args:
            q_pos: (T,) or (B, T) query positions.
            k_pos: (S,) or (B, S) key positions.

        Returns:
            (H, T, S) for 1-D positions or (B, H, T, S) for 2-D, float32.
        """
        relative = k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)  # (T, S) or (B, T, S)
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        buckets = self.hook_buckets(buckets)  # (T, S) or (B, T, S) (components/hooks.py)
        bias = self.hook_pos_embed(self.relative_attention_bias(buckets))  # (T, S, H) or (B, ...)
        return bias.movedim(-1, -3).float()  # (H, T, S) or (B, H, T, S)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, bound: int | None = None) -> ScoreMod:
        """`score_bias` as a score_mod: the bias of each relative distance, looked up per score.

        The buckets depend on j - i alone, so the learned table is gathered once per forward
        for every distance -(bound - 1) .. bound - 1, and each score reads its row.

        Args:
            q_pos: (T,) or (B, T) query positions.
            k_pos: (S,) or (B, S) key positions.
            bound: every position is below this; None -> read the largest from the tensors.

        Returns:
            (score, b, h, i, j) -> score.
        """
        if bound is None:
            bound = int(max(q_pos.max(), k_pos.max())) + 1  # one host sync, once per forward
        distances = torch.arange(-(bound - 1), bound, device=q_pos.device)  # (2 * bound - 1,)
        buckets = relative_position_bucket(
            distances, self.bidirectional, self.num_buckets, self.max_distance
        )
        by_distance = self.relative_attention_bias(buckets).float()  # (2 * bound - 1, H)
        q_at, k_at = position_reader(q_pos), position_reader(k_pos)
        last = 2 * bound - 2

        def t5_bias(score, b, h, i, j):
            # Clamped: a masked slot of a cache may hold any position; its score is discarded.
            row = (k_at(b, j) - q_at(b, i) + bound - 1).clamp(0, last)
            return score + by_distance[row, h].to(score.dtype)

        t5_bias.tensors = (by_distance,)  # what it reads that learns (see base.py)
        t5_bias.additive = True  # score + a bias: dS passes back unchanged (components/flash.py)
        return t5_bias
