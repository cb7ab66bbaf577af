"""One-token Linear layers for compiled decoding: a fused matrix-vector product (GEMV).

Decoding one token multiplies a (1, K) row by every weight matrix, so each step is a chain of
GEMVs, bound by how fast the weights stream from memory. PyTorch sends them to the BLAS's sgemv
(MKL on x86), which can stream large matrices well below the memory's speed. Written as a
multiply and a sum over K,

    y[n] = sum_k x[k] * W[n, k]          (x[..., None, :] * W).sum(-1)

torch.compile's inductor emits one vectorised loop that reads W once, closer to a plain copy's
speed (benchmarks/README.md). Int8Linear.compiled_forward (quantize/int8.py) uses the same form
for int8 weights.

Outside torch.compile this form would materialise the (N, K) products, and with more than one
row a GEMM is the right tool, so those calls keep F.linear. The math is nn.Linear's; only the
summation order differs (~1e-6 relative).

Shapes: (..., K) in, (..., N) out; W (N, K).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.accel.swap import swap_linears


class GemvLinear(nn.Linear):
    """nn.Linear whose one-row forward, inside torch.compile, is a fused GEMV (see above)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            y = (x.unsqueeze(-2) * self.weight).sum(-1)  # (..., 1, K) * (N, K) -> (..., N)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)  # (..., K) -> (..., N)


def use_gemv(model: nn.Module) -> int:
    """Put a GemvLinear in place of every plain nn.Linear of `model`; return how many.

    The new modules hold the same Parameters (tied ones included), so state_dict keys and
    values stay as they were; subclasses of nn.Linear (FastLinear, ...) keep their own forward.
    Eager results are unchanged: the GEMV form only runs inside torch.compile.
    """
    return swap_linears(model, GemvLinear, lambda m: type(m) is nn.Linear)
