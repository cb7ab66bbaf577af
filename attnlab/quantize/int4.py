"""Int4 weight-only quantization: asymmetric (min/max), one scale and minimum per group of
`group_size` consecutive inputs of each output row (group-wise along K).

    group g of row n:  scale = (max - min) / 15      q = round((w - min) / scale)  in [0, 15]
                       w ~= min + q * scale          |w - (min + q * scale)| <= scale / 2

Asymmetric, because a group's weights are rarely centred on zero: all 16 levels span exactly
[min, max]. Small groups (32) follow the weights closely at 0.25 extra bytes per weight for the
fp32 scale and minimum (4 + 2 bits per weight in all); 128 costs 0.0625.

Packing, two 4-bit values per byte (low nibble first), a plain layout any reader can undo:

    q[n]:       q0 q1 | q2 q3 | ...          packed[n, j] = q[n, 2j] | q[n, 2j+1] << 4
    packed[n]:  byte 0 | byte 1 | ...        packed: (N, K/2) uint8

The fused CPU kernel `torch.ops.aten._weight_int4pack_mm_for_cpu` computes
x @ ((q - 8) * scale + zero)^T with zero = min + 8 * scale, reading q from its own blocked layout
(`_convert_weight_to_int4pack_for_cpu`, which needs N divisible by 16, so rows are padded) and
scales/zeros interleaved as (K/group_size, N, 2). That layout is a PyTorch implementation
detail, so it is built from the plain one on the first kernel call and kept on the module as a
plain attribute: never saved, rebuilt after a load (it costs another 0.5 byte per weight).
Like the int8 kernel it is vectorised for bf16 activations only; see int8.py. On an x86 CPU
with AVX2 (qdot.choice()) the layer runs attnlab/accel/qdot.py's integer kernel instead
(llama.cpp's Q4_1 method, on its own layout built the same lazy way), and more rows than that
kernel is made for (a prefill) take the reference path: one dequantization, then the BLAS's
fp32 GEMM.

Shapes: N out_features, K in_features, G = K / group_size groups per row.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.accel import qdot

LEVELS = 15  # 4 bits: q in 0..15
KERNEL_MIDPOINT = 8  # the kernel stores q - 8 around a per-group "zero" (the value at q = 8)
KERNEL_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel accepts
KERNEL_DTYPE = torch.bfloat16


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """weight (N, K) float -> q (N, K) uint8 in 0..15, scales (N, G) fp32, mins (N, G) fp32."""
    N, K = weight.shape
    if group_size not in GROUP_SIZES or K % group_size:
        raise ValueError(
            f"int4 needs group_size in {GROUP_SIZES} dividing in_features; "
            f"got group_size={group_size}, in_features={K}"
        )
    w = weight.float().reshape(N, K // group_size, group_size)  # (N, G, group_size)
    mins, maxs = w.amin(dim=-1), w.amax(dim=-1)  # (N, G)
    # A constant group has max == min: any positive scale then gives q = 0, w = min exactly.
    scales = ((maxs - mins) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - mins[..., None]) / scales[..., None]).clamp(0, LEVELS)
    return q.to(torch.uint8).reshape(N, K), scales, mins


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) uint8 values in 0..15 -> (N, K/2) uint8, even columns in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 values in 0..15 (the inverse of pack_int4)."""
    low, high = packed & 0x0F, packed >> 4  # (N, K/2) each
    return torch.stack([low, high], dim=-1).flatten(1)  # (N, K/2, 2) -> (N, K)


def dequantize_int4(
    packed: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """packed (N, K/2), scales and mins (N, G) -> (N, K) weights in `dtype`."""
    q = unpack_int4(packed).float()  # (N, K)
    N, K = q.shape
    q = q.view(N, scales.shape[1], -1)  # (N, G, group_size)
    return (mins.float()[..., None] + q * scales.float()[..., None]).reshape(N, K).to(dtype)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def to_kernel_layout(
    packed: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype = KERNEL_DTYPE
) -> tuple[Tensor, Tensor]:
    """The CPU kernel's operands: (blocked weight, scales_and_zeros (G, N_pad, 2) in `dtype`)."""
    q = unpack_int4(packed).to(torch.int32)  # (N, K)
    pad = -q.shape[0] % KERNEL_ROW_MULTIPLE  # zero rows (scale 0): their outputs are cut off
    q, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, mins))
    zeros = mins + KERNEL_MIDPOINT * scales  # the weight at q = 8
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # (G, N_pad, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.to(
        dtype
    ).contiguous()


class Int4Linear(nn.Module):
    """A Linear whose weight is 4-bit, group-wise asymmetric.

    State: `weight` (N, K/2) uint8 (two values per byte), `scales` and `mins` (N, G) fp32,
    optional `bias` (N,): buffers only.

    Args:
        in_features: K.  out_features: N.  bias: whether there is a bias.
        group_size: inputs per (scale, min) pair; 32, 64, 128 or 256, dividing K.
        device: where to allocate ("meta" to load weights later with assign=True).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int = 32,
        device=None,
    ):
        super().__init__()
        if group_size not in GROUP_SIZES or in_features % group_size:
            raise ValueError(
                f"int4 needs group_size in {GROUP_SIZES} dividing in_features; "
                f"got group_size={group_size}, in_features={in_features}"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        G = in_features // group_size
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, G, device=device))
        self.register_buffer("mins", torch.zeros(out_features, G, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.use_kernel = int4_kernel_available()
        self.use_qdot = qdot.choice() == "qdot"  # an x86 CPU with AVX2 (accel/qdot.py)
        self._kernel: tuple[Tensor, Tensor] | None = None  # to_kernel_layout(...), built lazily
        self._blocks: Tensor | None = None  # qdot.q4_blocks(...), built lazily

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> "Int4Linear":
        """Quantize an nn.Linear's weight (its bias is kept as it is)."""
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, group_size, "meta"
        )
        q, module.scales, module.mins = quantize_int4(linear.weight, group_size)
        module.weight = pack_int4(q)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel = self._blocks = None  # new weights: rebuild the kernel layouts when used
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N)."""
        # The kernel has no backward: an input that needs a gradient (QLoRA's adapters below
        # this layer) takes the reference path, which autograd differentiates.
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        if self.use_kernel and x.device.type == "cpu" and not needs_grad:
            if self.use_qdot:  # integer dot products (accel/qdot.py)
                return self.qdot_forward(x)
            return self.kernel_forward(x)
        return self.reference_forward(x)

    def reference_forward(self, x: Tensor) -> Tensor:
        """Dequantize, then an ordinary F.linear: the definition of this layer."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dequantize_int4(self.weight, self.scales, self.mins, x.dtype), bias)

    def kernel_forward(self, x: Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> Tensor:
        """The fused int4 kernel, run in `dtype` (bf16: fast; fp32: exact but slow)."""
        if self._kernel is None or self._kernel[1].dtype != dtype:
            self._kernel = to_kernel_layout(self.weight, self.scales, self.mins, dtype)
        packed, scales_and_zeros = self._kernel
        x2 = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, packed, self.group_size, scales_and_zeros
        )  # (M, N_pad)
        y = y[:, : self.out_features].to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def qdot_forward(self, x: Tensor) -> Tensor:
        """attnlab/accel/qdot.py's int4 x int8 kernel (activations rounded to int8 per 32)."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self._blocks is None and not torch.compiler.is_compiling():
            self._blocks = qdot.q4_blocks(unpack_int4(self.weight), self.scales, self.mins)
        # A graph never builds the layout (a compiled step follows an eager prefill, which has).
        if x2.shape[0] > qdot.MAX_ROWS_INT4 or self.group_size % qdot.BLOCK or self._blocks is None:
            return self.reference_forward(x)
        y = qdot.q4_matmul(x2.float(), self._blocks, self.out_features).to(x.dtype)  # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}"
        )
