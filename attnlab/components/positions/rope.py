"""Rotary position embedding, RoPE (Su et al. 2021, arXiv:2104.09864).

RoPE turns each pair of query/key features into a 2-D point and rotates it by an angle
proportional to the token's position, so the score q_m . k_n depends only on m - n:

    (x1, x2) at position m  ->  (x1 cos(m w) - x2 sin(m w),  x2 cos(m w) + x1 sin(m w))

with one frequency w_i = theta^(-2i / R) per pair (R = rotary_dim). Which features form a pair
is a layout choice that checkpoints disagree on:

    "half"         pair (i, i + R/2)   HF Llama, GPT-NeoX   (rotate_half)
    "interleaved"  pair (2i, 2i + 1)   Meta's original Llama, GPT-J

The two give the same scores once the q_proj/k_proj rows are permuted (`permute_qk_weight`).
Partial rotary (GPT-NeoX, Phi) rotates only the first R = head_dim * partial_rotary features.

Context-extension scalings (`RopeScaling`) only change the frequencies and, for YaRN, scale
cos/sin by an attention factor: linear position interpolation (Chen et al. 2023,
arXiv:2306.15595), static and dynamic NTK-aware (bloc97 / emozilla, as HF), YaRN (Peng et al.
2023, arXiv:2309.00071) and Llama 3.1's per-band rule.

Shapes: B batch, H heads, T query length, S key length, D head_dim, R rotary_dim.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from attnlab.components.hooks import HookPoint
from attnlab.components.positions.base import PositionScheme, PositionTerms
from attnlab.components.positions.rope_scaling import RopeScaling, rope_inv_freq

Layout = Literal["half", "interleaved"]
LAYOUTS: tuple[str, ...] = ("half", "interleaved")


def _cos_sin(pos: Tensor, inv_freq: Tensor, attention_factor: float, layout: str):
    """cos/sin of pos * inv_freq, laid out to match the feature pairs. pos: (N,) -> (N, R)."""
    angles = torch.outer(pos.float(), inv_freq)  # (N, R/2)
    if layout == "half":
        angles = torch.cat((angles, angles), dim=-1)  # (N, R): [w0..w_{R/2-1}, w0..w_{R/2-1}]
    else:
        angles = angles.repeat_interleave(2, dim=-1)  # (N, R): [w0, w0, w1, w1, ...]
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_angles(
    rotary_dim: int,
    max_seq_len: int,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
    layout: Layout = "half",
    seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The cos/sin table for positions 0..max_seq_len-1, already times the attention factor.

    Args:
        rotary_dim: R, the number of rotated features.
        max_seq_len: number of positions in the table.
        theta: the base wavelength.
        scaling: optional context-extension scaling.
        layout: "half" repeats the R/2 frequencies as two blocks (HF Llama); "interleaved"
            repeats each frequency for its adjacent pair.
        seq_len: the current length, for dynamic NTK.

    Returns:
        (cos, sin), each (max_seq_len, R) float32.
    """
    _check_layout(layout)
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, theta, scaling, seq_len)
    return _cos_sin(torch.arange(max_seq_len), inv_freq, attention_factor, layout)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown RoPE layout {layout!r}; expected one of {LAYOUTS}")


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., R/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., R)


def _rotate_interleaved(x: Tensor) -> Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., R/2) each
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # (..., R): [-x2_0, x1_0, -x2_1, ...]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: Layout = "half") -> Tensor:
    """Rotate the first R features of x; the remaining D - R pass through unchanged.

    Args:
        x: (B, H, T, D) queries or keys.
        cos: (T, R) or (B, 1, T, R), from `rope_angles` in the same layout.
        sin: same shape as cos.
        layout: "half" or "interleaved".

    Returns:
        (B, H, T, D) rotated, in x's dtype (the rotation runs in at least float32).
    """
    _check_layout(layout)
    rotary_dim, dtype = cos.shape[-1], torch.promote_types(x.dtype, torch.float32)
    x_rot, x_pass = x[..., :rotary_dim].to(dtype), x[..., rotary_dim:]  # (B, H, T, R), (.., D - R)
    rotate = _rotate_half if layout == "half" else _rotate_interleaved
    x_rot = x_rot * cos.to(dtype) + rotate(x_rot) * sin.to(dtype)  # (B, H, T, R)
    return torch.cat((x_rot.to(x.dtype), x_pass), dim=-1)  # (B, H, T, D)


def permute_qk_weight(
    w: Tensor, n_heads: int, head_dim: int, to: Layout, rotary_dim: int | None = None
) -> Tensor:
    """Reorder q_proj/k_proj output rows so one RoPE layout reproduces the other's scores.

    Within each head, "half" pairs row i with row i + R/2 and "interleaved" pairs 2i with 2i+1.
    to="interleaved" moves rows (i, i + R/2) to (2i, 2i + 1); to="half" is its inverse (the
    `permute` in HF's convert_llama_weights_to_hf). Queries and keys get the same permutation,
    so every dot product, and so every attention score, is unchanged. Rows past R stay put.

    Args:
        w: (n_heads * head_dim, C) weight or (n_heads * head_dim,) bias.
        n_heads: heads in this projection (n_kv_heads for k_proj).
        head_dim: D.
        to: the layout the returned weight is meant for.
        rotary_dim: R; defaults to head_dim.

    Returns:
        a tensor shaped like w with rows reordered.
    """
    _check_layout(to)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if w.shape[0] != n_heads * head_dim:
        raise ValueError(
            f"weight has {w.shape[0]} rows, expected n_heads * head_dim = {n_heads} * {head_dim}"
        )
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    half = torch.arange(rotary_dim // 2)  # (R/2,)
    if to == "interleaved":
        rows = torch.stack((half, half + rotary_dim // 2), dim=-1).flatten()  # (R,): 0, R/2, 1, ..
    else:
        rows = torch.cat((2 * half, 2 * half + 1))  # (R,): 0, 2, 4, .., 1, 3, 5, ..
    rows = torch.cat((rows, torch.arange(rotary_dim, head_dim)))  # (D,)
    per_head = w.reshape(n_heads, head_dim, *w.shape[1:])  # (H, D, ...)
    return per_head[:, rows.to(w.device)].reshape(w.shape)  # (H * D, ...)


class RoPE(PositionScheme):
    """Rotary position embedding applied to queries and keys (Su et al. 2021).

    Args:
        head_dim: D, the per-head feature size (even).
        max_seq_len: positions to precompute; longer inputs extend the table on the fly.
        theta: the base wavelength (`rope_theta`).
        layout: "half" (HF Llama) or "interleaved" (Meta original, GPT-J).
        partial_rotary: fraction of head_dim to rotate; R = int(head_dim * partial_rotary).
        scaling: optional context-extension scaling; for kind "dynamic" use `DynamicNTKRoPE`,
            whose frequencies follow the input length.
    """

    # Whether the frequencies depend on the input length (dynamic NTK); see DynamicNTKRoPE.
    follows_length = False

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        theta: float = 10000.0,
        layout: Layout = "half",
        partial_rotary: float = 1.0,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RoPE needs a positive even head_dim, got head_dim={head_dim}")
        _check_layout(layout)
        if not 0 < partial_rotary <= 1:
            raise ValueError(f"partial_rotary must be in (0, 1], got {partial_rotary}")
        rotary_dim = int(head_dim * partial_rotary)  # int() truncates, as HF does
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim = int(head_dim * partial_rotary) = int({head_dim} * {partial_rotary})"
                f" = {rotary_dim} must be a positive even number"
            )
        if scaling is not None and scaling.kind == "dynamic" and not self.follows_length:
            raise ValueError(
                f"scaling kind {scaling.kind!r} recomputes the frequencies from the input length;"
                " build it with DynamicNTKRoPE(...)"
            )
        self.head_dim, self.rotary_dim, self.theta = head_dim, rotary_dim, theta
        self.layout, self.scaling = layout, scaling
        inv_freq, self.attention_factor = rope_inv_freq(rotary_dim, theta, scaling)
        # Non-persistent: all three are recomputed from the arguments above, so they stay out of
        # checkpoints (which then load into a model built with a different max_seq_len).
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (R/2,)
        cos, sin = self._table(torch.arange(max_seq_len))
        self.register_buffer("cos", cos, persistent=False)  # (max_seq_len, R)
        self.register_buffer("sin", sin, persistent=False)  # (max_seq_len, R)
        self.hook_cos, self.hook_sin = HookPoint(), HookPoint()  # components/hooks.py

    def _table(self, pos: Tensor, inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        return _cos_sin(
            pos.to(inv_freq.device), inv_freq.float(), self.attention_factor, self.layout
        )

    def tables_for(self, length: int) -> tuple[Tensor, Tensor]:
        """cos/sin tables, each (N, R) with N >= length, for positions 0..length-1.

        RoPE extrapolates, so a longer input grows the cache (doubling) instead of failing.
        """
        cached = self.cos.shape[0]
        if length > cached:
            self.cos, self.sin = self._table(torch.arange(max(length, 2 * cached)))
        return self.cos, self.sin

    def prepare(self, q_pos: Tensor, k_pos: Tensor, bound: int | None = None) -> "RotaryTerms":
        """The cos/sin rows of the new tokens, gathered once per forward for every layer.

        The table grows here, before any layer runs, when the positions go past it: with
        `bound` known from shapes nothing is read back from the device; without it the largest
        position is read once (one host sync per forward, never per layer).

        Args:
            q_pos: (T,) or (B, T) positions of the new tokens (their queries and keys).
            k_pos: (S,) or (B, S) positions of every key, or of every cache slot (unused: the
                keys a layer rotates are the new ones, at q_pos).
            bound: every position is below this, or None.

        Returns:
            RotaryTerms with cos/sin (T, R), or (B, 1, T, R) for 2-D positions.
        """
        # The current length is the newest query's position + 1, as in transformers: with a
        # preallocated cache, k_pos also holds the slots not written yet, and dynamic NTK would
        # rescale from the prefill on for a length the sequence has not reached.
        cos, sin = self.tables_for(self._length(q_pos, q_pos, bound))  # (N, R) each
        cos, sin = _gather(cos, sin, q_pos)
        cos, sin = self.hook_cos(cos), self.hook_sin(sin)  # what every layer rotates by
        return RotaryTerms(cos=cos, sin=sin, layout=self.layout)

    def _length(self, q_pos: Tensor, k_pos: Tensor, bound: int | None) -> int:
        """How many table rows this forward needs (see `prepare`)."""
        if bound is not None and not self.follows_length:
            return bound
        if torch.compiler.is_compiling():
            # Reading the largest position is a host sync (a graph break), so compiled code
            # trusts the table: size max_seq_len for the whole generation.
            return self.cos.shape[0]
        return int(torch.maximum(q_pos.max(), k_pos.max())) + 1  # one host sync, per forward

    def rotate_qk(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Rotate q by q_pos and k by k_pos (standalone; a model's layers use `prepare`).

        Args:
            q: (B, H, T, D) queries.  k: (B, K, S, D) keys.
            q_pos: (T,) or (B, T).    k_pos: (S,) or (B, S).

        Returns:
            (q, k) rotated, same shapes and dtypes.
        """
        cos, sin = self.tables_for(self._length(q_pos, k_pos, None))  # (N, R) each
        q = apply_rope(q, *_gather(cos, sin, q_pos), self.layout)  # (B, H, T, D)
        k = apply_rope(k, *_gather(cos, sin, k_pos), self.layout)  # (B, K, S, D)
        return q, k


@dataclass(frozen=True)
class RotaryTerms(PositionTerms):
    """RoPE's share of one forward: the cos/sin rows of the new tokens' positions.

    Attributes:
        cos, sin: (T, R) or (B, 1, T, R), gathered once by `RoPE.prepare`.
        layout: "half" or "interleaved".
    """

    cos: Tensor | None = None
    sin: Tensor | None = None
    layout: Layout = "half"

    def rotate_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate queries (B, H, T, D) and the new keys (B, K, T, D) by their positions."""
        q = apply_rope(q, self.cos, self.sin, self.layout)  # (B, H, T, D)
        return q, apply_rope(k, self.cos, self.sin, self.layout)  # (B, K, T, D)


def _gather(cos: Tensor, sin: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of the tables at pos: (T,) -> (T, R); (B, T) -> (B, 1, T, R) to broadcast over heads."""
    cos, sin = cos[pos], sin[pos]  # (T, R) or (B, T, R)
    if pos.dim() == 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, R)
    return cos, sin


class DynamicNTKRoPE(RoPE):
    """RoPE with dynamic NTK scaling: past the original length, frequencies follow the length.

    The frequencies are recomputed for the current length (largest position + 1) whenever it
    exceeds `scaling.original_max_seq_len`; shorter inputs use the unscaled table. Unlike HF,
    which keeps the largest length seen until the input drops below the original length, this
    is a pure function of the current length. As with HF, keys already in a KV cache keep the
    rotation they were written with, so cached decoding and a full forward differ past the
    original length; that is a property of the method, not of this code.
    """

    follows_length = True

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        theta: float = 10000.0,
        layout: Layout = "half",
        partial_rotary: float = 1.0,
        scaling: RopeScaling | None = None,
    ) -> None:
        if scaling is None or scaling.kind != "dynamic":
            raise ValueError(f"DynamicNTKRoPE needs a RopeScaling of kind 'dynamic', got {scaling}")
        super().__init__(head_dim, max_seq_len, theta, layout, partial_rotary, scaling)

    def tables_for(self, length: int) -> tuple[Tensor, Tensor]:
        if length <= self.scaling.original_max_seq_len:
            return super().tables_for(length)
        inv_freq, _ = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, seq_len=length)
        return self._table(torch.arange(length), inv_freq.to(self.inv_freq.device))
