"""Integer dot-product kernels for int4 and int8 weights on x86 CPUs.

PyTorch's fused CPU kernels for int4 and int8 weights (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) are vectorised for bf16 activations. A CPU with AVX2 only (most
laptops, AMD Zen 1-3, many cloud VMs) emulates bf16 and decodes several times slower than
llama.cpp on the same weights; one with AVX-512 BF16 does bf16 in hardware and is still
slower than these kernels for a decode step's one activation row (benchmarks/README.md section
9: both measured on one Zen 4). The kernels here do what llama.cpp does (csrc/qdot.cpp has the
equations): round the activations to int8 in blocks of 32 and multiply them by the weights'
integers with AVX2's integer dot-product instructions, one float scaling per block:

    x (M, K) fp32 ──int8 blocks of 32──> qx, d_x, sum(x)
    int4 row:  sum_b  d_w[b] d_x[b] (q[b] . qx[b])  +  m_w[b] sum(x[b])       (Q4_1 x Q8_1)
    int8 row:  s_w    sum_b d_x[b] (q[b] . qx[b])                             (Q8_0 x Q8_0)

The result differs from the exact one only by x's rounding to int8 (within 1/254 of each
block's largest |x|; tests/accel/test_qdot.py states the tolerance it checks).

`choice()` says which kernel a quantized Linear runs on this CPU: "qdot" on every x86 CPU with
AVX2, FMA and F16C where the kernels build, else "aten" (PyTorch's kernels: other CPUs, or no
compiler). ATTNLAB_QUANT_KERNEL=qdot|aten overrides it. Measured so far on AVX2 and on AVX-512
with BF16 (Zen 4), not on a CPU with AMX, where PyTorch's int4 kernel was the one measured in
benchmarks/README.md section 8 (`ATTNLAB_QUANT_KERNEL=aten` runs it).

The C++ source is compiled on first use, once per PyTorch version, by
torch.utils.cpp_extension (ninja and the system's C++ compiler) into PyTorch's extension cache
(~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), with one line on stderr while it builds.
Where that fails (no compiler), one line says so and the aten kernels run instead.

Shapes: M activation rows, K inputs (a multiple of 32), N outputs.
"""

import functools
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).parent / "csrc" / "qdot.cpp"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # every AVX2 CPU has FMA and F16C too
BLOCK = 32  # weights per block, as in llama.cpp's Q4_1 and Q8_0
BLOCK_BYTES = 20  # an int4 block: fp16 scale, fp16 minimum, 16 bytes of nibbles
# More activation rows (a long prefill chunk) take the layer's reference path: dequantize, then
# the BLAS GEMM, with exact fp32 activations. On SmolLM2's shapes, one thread, an AMD Zen 4 at
# its AVX-512 and at the AVX2 level, qdot was 3-10x faster at 16-64 rows and still ahead at 128,
# for int4 and int8 alike. int4 layers take qdot up to 128 rows (a short prompt's prefill was
# 5-10x slower through the reference path); int8 layers up to 16, where their activations'
# rounding to int8 stays small against the weights' own error (at 32 rows it took a test's
# logit error past its 1% bound).
MAX_ROWS = 16
MAX_ROWS_INT4 = 128
ENV = "ATTNLAB_QUANT_KERNEL"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def choice() -> str:
    """ "qdot" or "aten": the kernel quantized Linears run on this CPU (module docstring)."""
    forced = os.environ.get(ENV)
    if forced in ("qdot", "aten"):
        return forced if forced == "aten" or _runs_here() else "aten"
    if forced:
        warnings.warn(
            f"{ENV}={forced!r} is not 'qdot' or 'aten'; choosing by the CPU", stacklevel=2
        )
    return "qdot" if _runs_here() else "aten"


def _runs_here() -> bool:
    """An x86 CPU with AVX2, FMA and F16C, and the kernels built and loaded."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and {"avx2", "fma", "f16c"} <= cpu_flags() and load()


@functools.cache
def load() -> bool:
    """Compile (first time) and load the kernels: True when torch.ops.attnlab_qdot is there."""
    from torch.utils import cpp_extension

    name = "attnlab_qdot_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
    root = Path(cpp_extension.get_default_build_root())
    if not [*root.glob(f"{name}/*.so"), *root.glob(f"*/{name}/*.so")]:  # (per-Python subdirs)
        print(
            f"attnlab: compiling the int4/int8 CPU kernels into {root} (once, ~15 s)",
            file=sys.stderr,
        )
    try:
        cpp_extension.load(
            name,
            [str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the aten kernels still run
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(
            f"attnlab: the int4/int8 CPU kernels could not be built ({reason}); "
            "PyTorch's kernels run instead",
            file=sys.stderr,
        )
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Output shapes for torch.compile, which traces the ops without running them."""

    @torch.library.register_fake("attnlab_qdot::q4_matmul")
    def _(x, blocks, N):
        return x.new_empty(x.shape[0], N)

    @torch.library.register_fake("attnlab_qdot::q8_matmul")
    def _(x, q, scales):
        return x.new_empty(x.shape[0], q.shape[0])


def q4_blocks(q: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """The int4 kernel's weight layout from attnlab's values: q (N, K) in 0..15, scales and
    mins (N, G) with K / G a multiple of 32 -> (N, K / 32 * 20) uint8, one block per 32
    weights: fp16 scale, fp16 minimum, then byte j = q[j] | q[j + 16] << 4 (llama.cpp's
    block_q4_1). A GGUF's Q4_1 scales are fp16 already; others round to fp16 (2^-11 relative)."""
    N, K = q.shape
    nb = K // BLOCK
    per_group = nb // scales.shape[1]  # blocks per quantization group
    q = q.to(torch.uint8).view(N, nb, BLOCK)  # (N, nb, 32)
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # (N, nb, 16)
    d, m = (t.repeat_interleave(per_group, dim=1).to(torch.float16) for t in (scales, mins))
    d, m = (t.contiguous().view(torch.uint8).view(N, nb, 2) for t in (d, m))  # (N, nb, 2) each
    return torch.cat([d, m, nibbles], dim=-1).reshape(N, nb * BLOCK_BYTES).contiguous()


def q4_matmul(x: Tensor, blocks: Tensor, N: int) -> Tensor:
    """x (M, K) float32 times int4 weights in `q4_blocks` layout -> (M, N) float32."""
    return torch.ops.attnlab_qdot.q4_matmul(x.contiguous(), blocks, N)


def q8_matmul(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) float32 times q (N, K) int8 with per-row scales (N,) -> (M, N) float32."""
    return torch.ops.attnlab_qdot.q8_matmul(x.contiguous(), q, scales)
