"""Logit soft-capping: squash logits smoothly into (-cap, cap) with cap * tanh(x / cap).

Gemma 2 (Gemma Team 2024, arXiv:2408.00118 §2) caps the attention logits at 50 in every layer
and the final (vocabulary) logits at 30; Grok-1 does the same. Near zero tanh(x) ~ x, so small
logits pass unchanged, while no logit can exceed the cap, which keeps training stable without
a hard clip's zero gradient. In attention the cap applies to the scaled scores Q K^T * scale,
before the mask and the softmax, so it cannot run inside SDPA's fused kernels: a soft-capped
layer writes attention out (the "eager" backend, components/backends.py).

Shapes: any; the cap is elementwise.
"""

import torch
from torch import Tensor


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap): x's shape and dtype, every value within [-cap, cap] (strictly
    inside in exact arithmetic; fp32's tanh rounds to 1 past about 9 * cap)."""
    return torch.tanh(x / cap) * cap
