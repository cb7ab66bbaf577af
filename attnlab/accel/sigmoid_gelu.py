"""Inside torch.compile, GPT-2's GELU written as x * sigmoid(2u): the same function, one exp.

GPT-2's GELU ("gelu_new", `F.gelu(x, approximate="tanh")`) is 0.5 x (1 + tanh(u)) with
u = sqrt(2/pi) (x + 0.044715 x^3). Since 0.5 (1 + tanh u) = sigmoid(2u), it is also

    x * sigmoid(2u)

which inductor vectorises on CPU with one exp per element, where its tanh is slow; the forward
and backward kernels run faster (benchmarks/README.md) and agree with F.gelu to ~5e-7. Outside
torch.compile `gelu_tanh_sigmoid` is F.gelu itself.

The core's FFNs use F.gelu; `use_sigmoid_gelu(model)` switches their "gelu_tanh" activation to
this one, and the compiled training step turns it on explicitly.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.components.ffn import MLP, GatedMLP, gelu_tanh

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def gelu_tanh_sigmoid(x: Tensor) -> Tensor:
    """GPT-2's GELU; inside torch.compile in its sigmoid form (see above). x: any shape."""
    if not torch.compiler.is_compiling():
        return F.gelu(x, approximate="tanh")
    u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    return x * torch.sigmoid(2 * u)


def use_sigmoid_gelu(model: nn.Module) -> int:
    """Give every MLP / GatedMLP of `model` whose activation is "gelu_tanh" the sigmoid form;
    return how many."""
    ffns = [m for m in model.modules() if isinstance(m, MLP | GatedMLP) and m.act is gelu_tanh]
    for m in ffns:
        m.act = gelu_tanh_sigmoid
    return len(ffns)
