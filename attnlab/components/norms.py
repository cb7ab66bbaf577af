"""Normalisation layers: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

Gemma stores its RMSNorm weights as offsets from one and scales by (1 + weight), so a weight of
zero is the identity scale (`RMSNorm(unit_offset=True)`, HF's Gemma2RMSNorm / Gemma3RMSNorm).

Both compute their statistics in fp32 whatever the input dtype (a bf16 variance over thousands of
features loses most of its digits), then return the input dtype.

The math is written out in `layer_norm_reference` and `rms_norm_reference`; the modules run the
same math through PyTorch's fused kernels (F.layer_norm, F.rms_norm): written with ~8 elementwise
ops each, forward and backward, the norms took a sizeable share of a small model's training step
on CPU (benchmarks/README.md). tests/components/test_norms.py checks both against each other.

While a hook watches `hook_scale` or `hook_normalized` (TransformerLens' points: the divisor
sqrt(var + eps), (..., 1), and the centred input divided by it, before the weight), the norm
also runs its written-out formula so that both exist, and keeps the fused output unless a hook
edited one of them (as attention does with its scores, components/hooks.py).

Shapes: (..., C) in, (..., C) out.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, statistics over the last dimension.

    Args:
        dim: normalised width C.  eps: added to the variance.  bias: learn an additive bias.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.hook_in, self.hook_scale, self.hook_normalized = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        x = self.hook_in(x)  # (..., C): in a post-norm block, the residual sum
        bias = None if self.bias is None else self.bias.float()
        h = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        if self.hook_scale.fns or self.hook_normalized.fns:
            h = _watched(self, x.float() - x.float().mean(-1, keepdim=True), h, bias)
        return h.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight: LayerNorm without centring or bias.

    Args:
        dim: normalised width C.  eps: added to the mean square.
        unit_offset: scale by (1 + weight), the weight starting at zero (Gemma).
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.hook_in, self.hook_scale, self.hook_normalized = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        x = self.hook_in(x)  # (..., C): in a post-norm block, the residual sum
        scale = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()  # (C,)
        h = F.rms_norm(x.float(), self.weight.shape, scale, self.eps)
        if self.hook_scale.fns or self.hook_normalized.fns:
            h = _watched(self, x.float(), h, None, scale)
        return h.to(x.dtype)


def _watched(norm, centred: Tensor, out: Tensor, bias: Tensor | None, weight=None) -> Tensor:
    """A norm's scale and normalized input shown to its hooks; `out` (the fused result) unless
    a hook edited one of them, then the formula on what the hooks returned (fp32)."""
    weight = norm.weight.float() if weight is None else weight  # (C,)
    scale = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # (..., 1)
    hooked = norm.hook_scale(scale)
    normalized = centred / hooked  # (..., C)
    shown = norm.hook_normalized(normalized)
    if hooked is scale and shown is normalized:
        return out
    h = shown.float() * weight  # (..., C)
    return h if bias is None else h + bias


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm's formula, op by op, in fp32: what LayerNorm.forward computes fused."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)  # (..., 1)
    var = (h - mean).pow(2).mean(-1, keepdim=True)  # (..., 1), biased as in the paper
    h = (h - mean) * torch.rsqrt(var + eps) * weight.float()  # (..., C)
    return (h if bias is None else h + bias.float()).to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm's formula, op by op, in fp32: what RMSNorm.forward computes fused."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (..., C)
    return (h * weight.float()).to(x.dtype)


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def build_norm(
    kind: str, dim: int, eps: float, bias: bool = True, unit_offset: bool = False
) -> nn.Module:
    """A norm by name ("layernorm" | "rmsnorm"); `bias` applies to LayerNorm only,
    `unit_offset` (a (1 + weight) scale) to RMSNorm only."""
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, unit_offset)
    raise ValueError(f"unknown norm {kind!r}; choose from {list(NORMS)}")
