"""Position-wise feed-forward networks.

    MLP:       down_proj(act(up_proj(x)))                         (Vaswani et al. 2017, eq. 2)
    GatedMLP:  down_proj(act(gate_proj(x)) * up_proj(x))          (Shazeer 2020, "GLU variants")

SwiGLU is the gated form with SiLU, GeGLU with GELU. A gated FFN has three matrices instead of
two, so its default width is 8/3 * d_model (same parameters as a 4 * d_model MLP), rounded up to a
multiple of 64 for matmul-friendly shapes (Llama-2-7B rounds to 256 instead: 11008; its preset
sets d_ff explicitly).

Shapes: (B, T, C) in and out, F = d_ff hidden.
"""

import math

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's GELU ("gelu_new"): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).

    (Under torch.compile, attnlab/accel/sigmoid_gelu.py offers the same function in a form
    inductor compiles better; it is off unless turned on.)
    """
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact, with erf (BERT, the GELU paper)
    "gelu_tanh": gelu_tanh,  # GPT-2's "gelu_new"
    "silu": F.silu,
}
GATED_MULTIPLE = 64


def gated_d_ff(d_model: int, multiple: int = GATED_MULTIPLE) -> int:
    """Default hidden width of a gated FFN: 8/3 * d_model rounded up to `multiple`."""
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose from {list(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """Two-layer FFN: up_proj -> activation -> (dropout) -> down_proj.

    Args:
        d_model: C.  d_ff: hidden width F.  activation: a key of ACTIVATIONS.
        bias: biases on both projections.  dropout: on the hidden activations.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.act = _activation(activation)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)
        self.hook_in, self.hook_pre = HookPoint(), HookPoint()  # components/hooks.py
        self.hook_hidden, self.hook_out = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.hook_pre(self.up_proj(self.hook_in(x)))  # (B, T, F) before the activation
        h = self.hook_hidden(self.act(pre))  # (B, T, F)
        return self.hook_out(self.down_proj(self.drop(h)))  # (B, T, C)


class GatedMLP(nn.Module):
    """Gated FFN (SwiGLU with "silu", GeGLU with "gelu" or "gelu_tanh").

    Args:
        d_model: C.  d_ff: hidden width F; None -> gated_d_ff(d_model).
        activation: applied to the gate.  bias: biases on the projections.
        dropout: on the gated hidden activations.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        activation: str = "silu",
        bias: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        d_ff = gated_d_ff(d_model) if d_ff is None else d_ff
        self.act = _activation(activation)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)
        self.hook_in, self.hook_pre = HookPoint(), HookPoint()  # components/hooks.py
        self.hook_pre_linear = HookPoint()  # up_proj's output (hook_pre is the gate's)
        self.hook_hidden, self.hook_out = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        x = self.hook_in(x)
        gate = self.hook_pre(self.gate_proj(x))  # (B, T, F) before the activation
        h = self.hook_hidden(self.act(gate) * self.hook_pre_linear(self.up_proj(x)))  # (B, T, F)
        return self.hook_out(self.down_proj(self.drop(h)))  # (B, T, C)
