"""Position schemes: each plugs into the model through the hooks of `PositionScheme`."""

from attnlab.components.positions.alibi import ALiBi, alibi_slopes
from attnlab.components.positions.base import NoPosition, PositionScheme, PositionTerms
from attnlab.components.positions.learned import LearnedPosition
from attnlab.components.positions.rope import (
    DynamicNTKRoPE,
    RoPE,
    RopeScaling,
    RotaryTerms,
    apply_rope,
    permute_qk_weight,
    rope_angles,
    rope_inv_freq,
)
from attnlab.components.positions.sinusoidal import SinusoidalPosition, sinusoidal_table
from attnlab.components.positions.t5_bias import T5Bias, relative_position_bucket

__all__ = [
    "ALiBi",
    "DynamicNTKRoPE",
    "LearnedPosition",
    "NoPosition",
    "PositionScheme",
    "PositionTerms",
    "RoPE",
    "RopeScaling",
    "RotaryTerms",
    "SinusoidalPosition",
    "T5Bias",
    "alibi_slopes",
    "apply_rope",
    "permute_qk_weight",
    "relative_position_bucket",
    "rope_angles",
    "rope_inv_freq",
    "sinusoidal_table",
]
