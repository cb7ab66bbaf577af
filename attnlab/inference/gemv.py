"""One-token Linear layers for compiled decoding: a fused matrix-vector product (GEMV).

Decoding one token multiplies a (1, K) row by every weight matrix, so each step is a chain of
GEMVs, bound by how fast the weights stream from memory. PyTorch sends them to the BLAS's
sgemv (MKL on x86). On the 2-core AMD EPYC this was written on, MKL streamed GPT-2-small's 48
block weights (340 MB, more than the 32 MB L3) at ~12 GB/s, while a plain tensor copy moves
~26 GB/s. Written as a multiply and a sum over K,

    y[n] = sum_k x[k] * W[n, k]          (x[..., None, :] * W).sum(-1)

torch.compile's inductor emits one vectorised loop that reads W once: ~22 GB/s on the same
weights, and the 154 MB tied head in 6.3 ms instead of 13.3 (medians, one thread pool of 2).
Int8Linear.compiled_forward (quantize/int8.py) uses the same form for int8 weights.

Outside torch.compile this form would materialise the (N, K) products, and with more than one
row a GEMM is the right tool, so those calls keep F.linear. The math is nn.Linear's; only the
summation order differs (~1e-6 relative).

Shapes: (..., K) in, (..., N) out; W (N, K).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.inference.compiled_step import BoundDecodeStep
from attnlab.inference.packing import pack_weights


class GemvLinear(nn.Linear):
    """nn.Linear whose one-row forward, inside torch.compile, is a fused GEMV (see above)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            y = (x.unsqueeze(-2) * self.weight).sum(-1)  # (..., 1, K) * (N, K) -> (..., N)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)  # (..., K) -> (..., N)


def use_gemv(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into a GemvLinear; return how many.

    Only the class changes, so Parameters (tied ones included), state_dict keys and hooks stay
    as they were; subclasses of nn.Linear (FastLinear, ...) keep their own forward. Eager
    results are unchanged: the GEMV form only runs inside torch.compile.
    """
    modules = [m for m in model.modules() if type(m) is nn.Linear]
    for m in modules:
        m.__class__ = GemvLinear
    return len(modules)


# Inductor inlines a cheap elementwise producer into the loop of each consumer. Feeding a GEMV,
# that recomputes it once per output row: a LayerNorm's output (~12 ops per element) 3072 times
# in GPT-2's up projection and 50257 times in its head. With this threshold (inductor's CPU
# default is 50) such producers are written out once (a few KB per token) and each GEMV loop is
# one multiply-add per weight. Measured on GPT-2-small, 2-core AMD EPYC, ms per decoded token:
# int8 15.3 -> 9.3, fp32 21.3 -> 20.5 (the fp32 loops were already bound by memory).
REALIZE_OPCOUNT = 8


def compile_decode_step(model: nn.Module, **compile_kwargs) -> BoundDecodeStep:
    """`use_gemv(model)` and `pack_weights(model)` (inference/packing.py), then decode_step
    compiled for this model: a step_fn for stream_tokens (see inference/compiled_step.py, which
    also says what must not change in the model afterwards).

    compile_kwargs go to torch.compile; `options` (inductor settings) are merged over
    {"realize_opcount_threshold": REALIZE_OPCOUNT}.
    """
    use_gemv(model)
    pack_weights(model)
    options = {"realize_opcount_threshold": REALIZE_OPCOUNT, **compile_kwargs.pop("options", {})}
    return BoundDecodeStep(model, options, **compile_kwargs)
