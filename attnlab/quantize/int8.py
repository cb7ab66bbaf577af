"""Int8 weight-only quantization: one symmetric scale per output channel (row of the weight).

    scales[n] = max_k |w[n, k]| / 127          q[n, k] = round(w[n, k] / scales[n])  in [-127, 127]
    w[n, k]  ~= q[n, k] * scales[n]            |w - q * scale| <= scale / 2 per element

Only the weights are quantized; activations stay in floating point ("weight-only", as in
gpt-fast and torchao's int8_weight_only). Decoding one token reads every weight once, so it is
bound by memory bandwidth, and int8 weights are 4x fewer bytes than fp32.

Three forward paths compute the same thing:
- reference: dequantize to the activations' dtype, then F.linear. Readable, exact fp32 math, but
  it materialises the float weight on every call (slower than fp32 for one token).
- kernel: `torch.ops.aten._weight_int8pack_mm(x, q, scales)` = x @ (q * scales[:, None])^T, the
  fused CPU kernel (q stays int8 in memory). In PyTorch 2.13 it is vectorised (AVX-512/AVX2) for
  bf16 activations only; fp32 activations take a scalar loop ~10x slower than fp32 F.linear. So
  the kernel path rounds x and the scales to bf16 (KERNEL_DTYPE) and the result back to x's
  dtype: it agrees with the reference to bf16 precision (~2^-8 relative), see the tests.
- compiled: one token inside torch.compile (a compiled decode_step) is written as
  (x * q).sum(-1) * scales, which inductor turns into a single fused int8 GEMV (see
  `compiled_forward`; faster than the aten kernel, benchmarks/README.md has the figures).

The kernel's multi-row path (more than one token) in PyTorch 2.13 uses aligned vector loads
without tails: it crashes or returns garbage unless in_features % 16 == 0, the activations are
32-byte aligned and the weight 16-byte aligned. So layers with other widths take the reference
path, the activations are always a fresh copy, and weights loaded from a file (safetensors packs
tensors at arbitrary offsets) are copied to an aligned buffer once, at load.

On an x86 CPU with AVX2 (qdot.choice()) the kernel path is attnlab/accel/qdot.py's integer
kernel instead (activations rounded to int8 in blocks of 32, as llama.cpp's Q8_0 x Q8_0), for
the few rows it is made for; more rows (a prefill) take the reference path and the BLAS's fp32
GEMM.

Shapes: N out_features, K in_features, (..., K) activations in, (..., N) out.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.accel import qdot

QMAX = 127  # symmetric: -127..127, so q and -q are both representable (-128 is unused)
KERNEL_DTYPE = torch.bfloat16  # the dtype the CPU kernel is fast in (see the module docstring)
KERNEL_K_MULTIPLE = 16  # the kernel reads 16 inputs at a time, with no tail (see above)
ALIGNMENT = 64  # bytes; PyTorch's CPU allocator aligns every new tensor to this


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: weight (N, K) -> (q (N, K) int8, scales (N,) fp32)."""
    w = weight.float()
    # An all-zero row would give scale 0 (0/0 below); the smallest normal float keeps q = 0.
    scales = (w.abs().amax(dim=1) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)  # (N, K)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q (N, K) int8, scales (N,) -> (N, K) weights in `dtype`."""
    return (q.float() * scales.float()[:, None]).to(dtype)


def int8_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_kernel_matmul(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) @ (q * scales[:, None])^T -> (M, N), in x's dtype (scales are cast to it)."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scales.to(x.dtype))


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 with one scale per output channel.

    State: `weight` (N, K) int8, `scales` (N,) fp32, optional `bias` (N,) float, all buffers:
    a quantized layer is for inference, nothing in it trains.

    Args:
        in_features: K.  out_features: N.  bias: whether there is a bias.
        device: where to allocate (use "meta" to load weights later with assign=True).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        # False: always the reference path (also for widths the kernel mishandles, see above)
        self.use_kernel = int8_kernel_available() and in_features % KERNEL_K_MULTIPLE == 0
        # integer dot products (accel/qdot.py), for widths it takes
        self.use_qdot = qdot.choice() == "qdot" and in_features % qdot.BLOCK == 0

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an nn.Linear's weight (its bias is kept as it is)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, "meta")
        module.weight, module.scales = quantize_int8(linear.weight)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.weight.device.type == "cpu" and self.weight.data_ptr() % ALIGNMENT:
            self.weight = self.weight.clone()  # an aligned copy for the kernel (see above)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N)."""
        # The kernels have no backward: an input that needs a gradient (QLoRA's adapters below
        # this layer) takes the reference path, which autograd differentiates.
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        fast = self.use_kernel and x.device.type == "cpu" and not needs_grad
        if fast and self.use_qdot:
            return self.qdot_forward(x)
        if torch.compiler.is_compiling():  # inductor 2.13 cannot lower the aten kernel
            one_token = x.shape[:-1].numel() == 1  # decode_step: the fused int8 GEMV
            return self.compiled_forward(x) if one_token else self.reference_forward(x)
        return self.kernel_forward(x) if fast else self.reference_forward(x)

    def reference_forward(self, x: Tensor) -> Tensor:
        """Dequantize, then an ordinary F.linear: the definition of this layer."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dequantize_int8(self.weight, self.scales, x.dtype), bias)

    def kernel_forward(self, x: Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> Tensor:
        """The fused int8 kernel, run in `dtype` (bf16: fast; fp32: exact but slow)."""
        x2 = x.reshape(-1, self.in_features).to(dtype, copy=True)  # (M, K), fresh: aligned
        y = int8_kernel_matmul(x2, self.weight, self.scales).to(x.dtype)  # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def qdot_forward(self, x: Tensor) -> Tensor:
        """attnlab/accel/qdot.py's int8 x int8 kernel (activations rounded to int8 per 32)."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] > qdot.MAX_ROWS:
            return self.reference_forward(x)
        y = qdot.q8_matmul(x2.float(), self.weight, self.scales).to(x.dtype)  # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def compiled_forward(self, x: Tensor) -> Tensor:
        """For one token under torch.compile: a multiply and a sum over K, which inductor fuses
        into one vectorised loop reading the int8 weight directly (exact fp32 math, 4x fewer
        bytes than fp32). The aten kernel would stay an opaque call; dequantize + F.linear would
        write the float weight out first. In eager mode this form would materialise (N, K)."""
        w = self.weight.to(x.dtype)  # (N, K), never stored once fused
        y = (x.unsqueeze(-2) * w).sum(-1) * self.scales.to(
            x.dtype
        )  # (..., 1, K) * (N, K) -> (..., N)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"
