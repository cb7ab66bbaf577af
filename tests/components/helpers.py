"""Build an AttentionContext for one layer tested on its own, as a model's forward would."""

import torch
from torch import Tensor

from attnlab.components.context import AttentionContext
from attnlab.components.positions.base import NO_TERMS, PositionScheme


def context(
    x: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    memory: Tensor | None = None,
    memory_mask: Tensor | None = None,
    positions: PositionScheme | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    slots: Tensor | None = None,
) -> AttentionContext:
    """The context a model would hand this layer.

    Args:
        x: (B, T, C), the layer's input.
        mask: the layer's own mask: self-attention's, or with `memory` given (a cross-attention
            layer) the memory's, unless memory_mask is given too.
        q_pos: default 0..T-1.  k_pos: default q_pos.
    """
    q_pos = torch.arange(x.shape[1]) if q_pos is None else q_pos
    k_pos = q_pos if k_pos is None else k_pos
    if memory is not None and memory_mask is None:
        memory_mask = mask
    terms = NO_TERMS if positions is None else positions.prepare(q_pos, k_pos)
    return AttentionContext(mask, is_causal, terms, slots, memory, memory_mask)
