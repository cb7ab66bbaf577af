"""RoPE context-extension scalings: each only changes the rotation frequencies (and, for YaRN,
scales cos/sin by an attention factor).

- linear position interpolation (Chen et al. 2023, arXiv:2306.15595)
- static and dynamic NTK-aware (bloc97 / emozilla, as in HF)
- YaRN (Peng et al. 2023, arXiv:2309.00071)
- Llama 3.1's per-band rule

R = rotary_dim, the number of rotated features.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

SCALING_KINDS: tuple[str, ...] = ("linear", "ntk", "dynamic", "yarn", "llama3")

# YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22).
YARN_MSCALE_COEFF = 0.1


@dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE beyond the context length it was trained on.

    Args:
        kind: "linear" (position interpolation), "ntk" (static NTK-aware), "dynamic" (NTK-aware,
            recomputed from the current length), "yarn" or "llama3".
        factor: context extension ratio s >= 1 (new length / original_max_seq_len).
        original_max_seq_len: the context length used in pre-training.
        low_freq_factor: Llama 3: wavelengths above original_max_seq_len / low_freq_factor are
            fully interpolated.
        high_freq_factor: Llama 3: wavelengths below original_max_seq_len / high_freq_factor are
            left alone; the band in between is blended.
        beta_fast: YaRN: pairs that rotate more than beta_fast times in the original context
            are not interpolated.
        beta_slow: YaRN: pairs that rotate fewer than beta_slow times are fully interpolated.
        attention_factor: YaRN: the cos/sin multiplier; None means 0.1 ln(factor) + 1.
    """

    kind: Literal["linear", "ntk", "dynamic", "yarn", "llama3"]
    factor: float
    original_max_seq_len: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCALING_KINDS:
            raise ValueError(
                f"unknown RoPE scaling kind {self.kind!r}; expected one of {SCALING_KINDS}"
            )
        if not self.factor >= 1.0:
            raise ValueError(f"RoPE scaling factor must be >= 1, got {self.factor}")
        if self.original_max_seq_len <= 0:
            raise ValueError(
                f"original_max_seq_len must be positive, got {self.original_max_seq_len}"
            )
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "need 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                f"need 0 < beta_slow < beta_fast, got beta_slow={self.beta_slow}, "
                f"beta_fast={self.beta_fast}"
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"attention_factor must be positive, got {self.attention_factor}")


def _base_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """w_i = theta^(-2i/R) for i < R/2, float32 (the same arithmetic as HF, so tables match)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # (R/2,)
    return 1.0 / (theta**exponents)  # (R/2,)


def _ntk_exponent(rotary_dim: int) -> float:
    if rotary_dim <= 2:
        raise ValueError(f"NTK-aware RoPE scaling needs rotary_dim > 2, got {rotary_dim}")
    return rotary_dim / (rotary_dim - 2)


def _linear(rotary_dim: int, theta: float, s: RopeScaling, seq_len: int | None):
    # Position interpolation: position m becomes m / s, i.e. every frequency is divided by s.
    return _base_inv_freq(rotary_dim, theta) / s.factor, 1.0


def _ntk(rotary_dim: int, theta: float, s: RopeScaling, seq_len: int | None):
    # Raise the base so the lowest frequency is interpolated by s and the highest barely moves.
    return _base_inv_freq(rotary_dim, theta * s.factor ** _ntk_exponent(rotary_dim)), 1.0


def _dynamic(rotary_dim: int, theta: float, s: RopeScaling, seq_len: int | None):
    # NTK-aware with the factor grown from the current length; at or below the original length
    # the bracket is exactly 1, so short sequences see the unscaled frequencies.
    length = max(seq_len or s.original_max_seq_len, s.original_max_seq_len)
    ratio = s.factor * length / s.original_max_seq_len - (s.factor - 1)
    return _base_inv_freq(rotary_dim, theta * ratio ** _ntk_exponent(rotary_dim)), 1.0


def _yarn(rotary_dim: int, theta: float, s: RopeScaling, seq_len: int | None):
    inv_freq = _base_inv_freq(rotary_dim, theta)  # (R/2,)

    def pair_index(n_rotations: float) -> float:
        # The pair i whose wavelength fits n_rotations times into the original context.
        return (
            rotary_dim
            * math.log(s.original_max_seq_len / (n_rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    # Pairs below `low` rotate often (> beta_fast turns): keep them. Above `high`: interpolate.
    low = max(math.floor(pair_index(s.beta_fast)), 0)
    high = min(math.ceil(pair_index(s.beta_slow)), rotary_dim - 1)
    high = high + 0.001 if high == low else high  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / s.factor * ramp + inv_freq * (1 - ramp)  # (R/2,)
    if s.attention_factor is not None:
        return inv_freq, s.attention_factor
    return inv_freq, YARN_MSCALE_COEFF * math.log(s.factor) + 1.0


def _llama3(rotary_dim: int, theta: float, s: RopeScaling, seq_len: int | None):
    inv_freq = _base_inv_freq(rotary_dim, theta)  # (R/2,)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    # Long wavelengths are interpolated by the factor, short ones kept, the band between blended.
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out), 1.0


_SCALINGS = {"linear": _linear, "ntk": _ntk, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """The rotation frequency of each feature pair, after any context-extension scaling.

    Args:
        rotary_dim: R, the number of rotated features (even).
        theta: the base wavelength (10000 in the paper, `rope_theta`).
        scaling: optional context-extension scaling.
        seq_len: the current length; only dynamic NTK uses it.

    Returns:
        (inv_freq, attention_factor): inv_freq is (R/2,) float32; attention_factor multiplies
        cos and sin (1.0 except YaRN's mscale).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if scaling is None:
        return _base_inv_freq(rotary_dim, theta), 1.0
    return _SCALINGS[scaling.kind](rotary_dim, theta, scaling, seq_len)
