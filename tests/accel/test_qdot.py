"""accel/qdot.py's int4 and int8 kernels against the plain dequantized layers (the reference).

The kernels round the activations to int8 in blocks of 32 (d_x = max|x| / 127, qx = round(x /
d_x)), so they are not bit-equal to x @ W^T. The tolerance is that rounding's own bound, per
output: |x_j - d_x qx_j| <= d_x / 2, so for y_n = sum_j w_nj x_j

    int4 (w = d q + m, the m term exact):  |err_n| <= sum_j d_b q_nj d_x,b / 2
    int8 (w = s q):                        |err_n| <= sum_j s_n |q_nj| d_x,b / 2

plus fp32 accumulation (1e-5 relative to sum_j |w_nj x_j|). A kernel that drops a block, a
scale or a minimum, or misreads a nibble, lands far outside it: each test also checks that the
error is a small fraction of the bound's scale, so the bound is not vacuous.
"""

import struct

import pytest
import torch
from torch import nn

from attnlab.accel import qdot
from attnlab.quantize.int4 import Int4Linear, dequantize_int4, unpack_int4
from attnlab.quantize.int8 import Int8Linear, dequantize_int8
from tests.compile_helpers import needs_compiler

pytestmark = pytest.mark.skipif(
    not qdot._runs_here(), reason="needs an x86 CPU with AVX2/FMA/F16C and a C++ compiler"
)


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> d_x (M, K/32) and the rounding step per element (M, K): d_x / 2."""
    blocks = x.view(x.shape[0], -1, 32)  # (M, nb, 32)
    d = blocks.abs().amax(-1) / 127  # (M, nb)
    return d, (d / 2).repeat_interleave(32, dim=1)


def fp16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def int4_case(N: int, K: int, seed: int):
    """Int4 weights whose scales and minimums are fp16 numbers (as a GGUF's Q4_1 are)."""
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=False)
    layer = Int4Linear.from_linear(lin, 32)
    layer.scales.copy_(fp16_exact(layer.scales))
    layer.mins.copy_(fp16_exact(layer.mins))
    return layer


def test_q4_blocks_is_llama_cpps_block_q4_1():
    layer = int4_case(N=3, K=64, seed=0)
    q = unpack_int4(layer.weight)  # (N, K)
    blocks = qdot.q4_blocks(q, layer.scales, layer.mins)
    assert blocks.shape == (3, 2 * 20) and blocks.dtype == torch.uint8
    for n in range(3):
        for b in range(2):
            qs = q[n, 32 * b : 32 * b + 32].tolist()
            expected = struct.pack(
                "<ee16B",
                layer.scales[n, b].item(),
                layer.mins[n, b].item(),
                *[qs[j] | qs[j + 16] << 4 for j in range(16)],
            )
            assert bytes(blocks[n, 20 * b : 20 * b + 20].tolist()) == expected


@pytest.mark.parametrize("M", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_q4_matmul_within_the_activation_rounding_bound(M, N):
    K = 96
    layer = int4_case(N, K, seed=M * 100 + N)
    x = torch.randn(M, K) * torch.linspace(0.1, 3, K)  # blocks of different scales
    x[0, 5] = 40.0  # an outlier: its block's d_x is large
    blocks = qdot.q4_blocks(unpack_int4(layer.weight), layer.scales, layer.mins)
    y = qdot.q4_matmul(x, blocks, N)  # (M, N)
    w = dequantize_int4(layer.weight, layer.scales, layer.mins).double()  # (N, K)
    exact = x.double() @ w.T
    _, step = int8_activations(x)
    d_w = layer.scales.repeat_interleave(32, dim=1).double()  # (N, K)
    q = unpack_int4(layer.weight).double()
    bound = step.double() @ (d_w * q).T + 1e-5 * (x.double().abs() @ w.abs().T)
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # it did round: the bound is what is being checked
    assert err.mean() < 0.5 * bound.mean()  # rounding errors partly cancel


@pytest.mark.parametrize("M", [1, 4, 9])
@pytest.mark.parametrize("N", [5, 33])
def test_q8_matmul_within_the_activation_rounding_bound(M, N):
    K = 128
    torch.manual_seed(M * 10 + N)
    layer = Int8Linear.from_linear(nn.Linear(K, N, bias=False))
    x = torch.randn(M, K) * 2
    y = qdot.q8_matmul(x, layer.weight, layer.scales)
    w = dequantize_int8(layer.weight, layer.scales).double()
    exact = x.double() @ w.T
    _, step = int8_activations(x)
    bound = step.double() @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0


def test_the_kernels_compute_in_exact_integers():
    """Activations already on the int8 grid round to themselves: then the only error left
    is fp32 accumulation (a nibble or sign mix-up would show here at full size)."""
    torch.manual_seed(3)
    layer = int4_case(N=40, K=64, seed=3)
    qx = torch.randint(-127, 128, (2, 64)).float()
    qx[:, ::32] = 127  # each block's max |x| is 127: d_x = 1, x = qx exactly
    blocks = qdot.q4_blocks(unpack_int4(layer.weight), layer.scales, layer.mins)
    w4 = dequantize_int4(layer.weight, layer.scales, layer.mins)
    torch.testing.assert_close(qdot.q4_matmul(qx, blocks, 40), qx @ w4.T, rtol=1e-5, atol=1e-3)
    int8 = Int8Linear.from_linear(nn.Linear(64, 40, bias=False))
    w8 = dequantize_int8(int8.weight, int8.scales)
    torch.testing.assert_close(
        qdot.q8_matmul(qx, int8.weight, int8.scales), qx @ w8.T, rtol=1e-5, atol=1e-3
    )


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_layers_take_the_kernel_for_few_rows_and_the_reference_for_many(kind):
    torch.manual_seed(4)
    lin = nn.Linear(64, 48, bias=True)
    layer = Int4Linear.from_linear(lin, 32) if kind == "int4" else Int8Linear.from_linear(lin)
    layer.use_kernel, layer.use_qdot = True, True
    most = qdot.MAX_ROWS_INT4 if kind == "int4" else qdot.MAX_ROWS
    few, many = torch.randn(2, 3, 64), torch.randn(1, most + 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(many), layer.reference_forward(many))  # exact path
        y, ref = layer(few), layer.reference_forward(few)
    assert y.shape == (2, 3, 48)
    assert 0 < (y - ref).abs().max() < 0.02 * ref.abs().max()  # the kernel ran, and is close


@pytest.mark.slow
@needs_compiler
def test_compiled_calls_give_the_eager_result():
    torch.manual_seed(5)
    layer = Int4Linear.from_linear(nn.Linear(64, 32), 32)
    layer.use_kernel, layer.use_qdot = True, True
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        eager = layer(torch.nn.functional.silu(x))  # builds the block layout
        compiled = torch.compile(lambda t: layer(torch.nn.functional.silu(t)))(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_choice_follows_the_override(monkeypatch):
    for forced in ("qdot", "aten"):
        monkeypatch.setenv(qdot.ENV, forced)
        qdot.choice.cache_clear()
        assert qdot.choice() == forced
    monkeypatch.setenv(qdot.ENV, "bogus")
    qdot.choice.cache_clear()
    with pytest.warns(UserWarning, match="ATTNLAB_QUANT_KERNEL"):
        assert qdot.choice() in ("qdot", "aten")
    monkeypatch.delenv(qdot.ENV)
    qdot.choice.cache_clear()


def test_threads_split_the_rows_and_give_the_one_thread_result():
    """Each output row is one thread's (at::parallel_for over rows, built with OpenMP), so two
    threads give the one-thread bits; 1024 rows are 16 tasks of GRAIN 64."""
    torch.manual_seed(6)
    layer4 = Int4Linear.from_linear(nn.Linear(96, 1024), 32)
    layer8 = Int8Linear.from_linear(nn.Linear(96, 1024))
    blocks = qdot.q4_blocks(unpack_int4(layer4.weight), layer4.scales, layer4.mins)
    x = torch.randn(3, 96)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (qdot.q4_matmul(x, blocks, 1024), qdot.q8_matmul(x, layer8.weight, layer8.scales))
            )
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert torch.equal(one, two)
