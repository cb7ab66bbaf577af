"""The common interface every position scheme plugs in through.

A position scheme touches the model in at most one of three places, and each hook is a no-op by
default, so `Attention` and the models call all three and never ask which scheme they hold:

    embed(x, pos)                  added to the token embeddings   (sinusoidal, learned)
    rotate_qk(q, k, q_pos, k_pos)  rotates queries and keys         (RoPE)
    score_bias(q_pos, k_pos)       added to the attention scores    (ALiBi, T5 relative bias)

What every layer needs of the last two is the same in every layer, so the model asks for it once
per forward, and each layer only applies it (gpt-fast builds `freqs_cis` once the same way):

    terms = scheme.prepare(q_pos, k_pos)     once per forward, in the model: gathered cos/sin
                                             rows (RoPE) or the score bias (ALiBi, T5)
    q, k = terms.rotate_qk(q, k)             in every layer; `terms.bias` is added to the scores

The flex attention backend (components/flex.py) takes the bias in a second form, a `score_mod`:
a function (score, b, h, i, j) -> score of one score's indices, closed over a few numbers per
head (ALiBi's slopes, T5's bias per relative distance), so the (H, T, S) tensor is never built.
A scheme built for that backend has `bias_form = "score_mod"` (models/build.py sets it), and
`prepare` then puts `score_mod(...)` into `PositionTerms.bias` in place of the tensor; layers
hand it to their backend either way. A score_mod lists the tensors its closure reads in a
`tensors` attribute (T5's gathered bias table): FlashAttention's autograd.Function, which cannot
see into a closure, takes them as inputs and gives them their gradients (components/flash.py).
With `bias_form = "auto"` (the "auto" attention backend) `prepare` picks the form per forward from
the shapes (`wants_score_mod`): a score_mod for a long query block, the small tensor for a decode
step; the "auto" backend then follows that form.

Positions are absolute int64 indices, shaped (T,) when every row of the batch shares them or
(B, T) when rows differ (left-padded batches, cached decoding). A score bias moves SDPA off its
flash kernel (it becomes a float mask), so bias-based schemes run on the math/efficient kernels.

Shapes: B batch, T query length, S key length, C d_model, H query heads, K kv heads, D head_dim.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""(score, b, h, i, j) -> the modified score, every argument a 0-d tensor (FlexAttention)."""

AUTO_MIN_SCORES = 128 * 128
"""bias_form "auto": the fewest scores per head (T * S) worth a score_mod: one flex block."""


def wants_score_mod(T: int, S: int) -> bool:
    """bias_form "auto": the bias as a score_mod (so the layers run flex) for T queries, S keys?

    Yes for a query block of at least one flex block of scores (128 x 128): there the dense
    (H, T, S) bias costs memory and keeps SDPA off its flash kernel. No for a decode step (T = 1)
    or a short block: the (H, 1, S) tensor is small, and flex compiles once per shape while a
    decode step's shapes change as the sequence grows.
    """
    return T > 1 and T * S >= AUTO_MIN_SCORES


@dataclass(frozen=True)
class PositionTerms:
    """A scheme's share of one forward, prepared once and applied by every layer.

    Attributes:
        bias: (H, T, S) or (B, H, T, S) float32 added to the scores; or, for a scheme with
            `bias_form = "score_mod"`, a score_mod (score, b, h, i, j) -> score; or None.
    """

    bias: Tensor | ScoreMod | None = None

    def rotate_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate the queries and the new keys (both at the queries' positions); here: as given.

        Args:
            q: (B, H, T, D).  k: (B, K, T, D), the keys of the same T tokens.

        Returns:
            (q, k) with the same shapes and dtypes.
        """
        return q, k


NO_TERMS = PositionTerms()


def position_reader(pos: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """(b, i) -> pos[i] for (T,) positions, pos[b, i] for (B, T): for a score_mod to read."""
    if pos.dim() == 1:
        return lambda b, i: pos[i]
    return lambda b, i: pos[b, i]


class PositionScheme(nn.Module):
    """Base class: a scheme with no position information (every hook is the identity)."""

    # The largest number of positions the scheme can represent (a table's size), or None.
    max_positions: int | None = None
    # Which form `prepare` gives the score bias in: a dense tensor, a score_mod for the flex
    # backend, or "auto", one of the two by the shapes (set by the builder; schemes without a
    # bias ignore it).
    bias_form: Literal["tensor", "score_mod", "auto"] = "tensor"

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

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, bound: int | None = None) -> ScoreMod | None:
        """`score_bias` as a score_mod: score + bias[b, h, i, j], without building the tensor.

        Args:
            q_pos: (T,) or (B, T).  k_pos: (S,) or (B, S).
            bound: every position is below this, when known (see `prepare`).

        Returns:
            (score, b, h, i, j) -> score, reading q_pos[i] / k_pos[j] (row b for 2-D); or None.
        """
        return None

    def prepare(self, q_pos: Tensor, k_pos: Tensor, bound: int | None = None) -> PositionTerms:
        """What every layer of one forward needs, computed once by the model.

        The new keys a layer projects sit at the queries' positions (self-attention); `k_pos`
        covers every key the queries see (with a cache: every slot).

        Args:
            q_pos: (T,) or (B, T) positions of the new tokens.
            k_pos: (S,) or (B, S) positions of all keys.
            bound: every position is below this, when the caller knows it from shapes (the
                length, the cache size), so no scheme has to read the largest one from the device.

        Returns:
            PositionTerms: here the score bias (None for schemes without one), as a tensor or,
            with `bias_form = "score_mod"` (or "auto" and `wants_score_mod`), as a score_mod.
        """
        form = self.bias_form
        if form == "auto":
            form = "score_mod" if wants_score_mod(q_pos.shape[-1], k_pos.shape[-1]) else "tensor"
        if form == "score_mod":
            bias = self.score_mod(q_pos, k_pos, bound)
        else:
            bias = self.score_bias(q_pos, k_pos)
        return NO_TERMS if bias is None else PositionTerms(bias=bias)


class NoPosition(PositionScheme):
    """No positions at all: an encoder built with it is permutation-equivariant."""
