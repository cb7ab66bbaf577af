"""The common interface every position scheme plugs in through.

A position scheme touches the model in at most one of three places, and each hook is a no-op by
default, so `Attention` and the models call all three and never ask which scheme they hold:

    embed(x, pos)                  added to the token embeddings   (sinusoidal, learned)
    rotate_qk(q, k, q_pos, k_pos)  rotates queries and keys         (RoPE)
    score_bias(q_pos, k_pos)       added to the attention scores    (ALiBi, T5 relative bias)

Positions are absolute int64 indices, shaped (T,) when every row of the batch shares them or
(B, T) when rows differ (left-padded batches, cached decoding). A score bias moves SDPA off its
flash kernel (it becomes a float mask), so bias-based schemes run on the math/efficient kernels.

Shapes: B batch, T query length, S key length, C d_model, H query heads, K kv heads, D head_dim.
"""

from torch import Tensor, nn


class PositionScheme(nn.Module):
    """Base class: a scheme with no position information (every hook is the identity)."""

    # The largest number of positions the scheme can represent (a table's size), or None.
    max_positions: int | None = None

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Add absolute position information to token embeddings.

        Args:
            x: (B, T, C) token embeddings.
            pos: (T,) or (B, T) absolute positions.

        Returns:
            (B, T, C) embeddings with positions mixed in.
        """
        return x

    def rotate_qk(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys by their positions.

        Args:
            q: (B, H, T, D) queries.  k: (B, K, S, D) keys.
            q_pos: (T,) or (B, T).    k_pos: (S,) or (B, S).

        Returns:
            (q, k) with the same shapes and dtypes.
        """
        return q, k

    def score_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """A bias added to the attention scores, or None.

        Args:
            q_pos: (T,) or (B, T).  k_pos: (S,) or (B, S).

        Returns:
            (H, T, S) for 1-D positions or (B, H, T, S) for 2-D positions, float32; or None.
        """
        return None


class NoPosition(PositionScheme):
    """No positions at all: an encoder built with it is permutation-equivariant."""
