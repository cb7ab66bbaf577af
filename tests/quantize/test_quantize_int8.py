"""Int8 weight-only quantization (attnlab/quantize/int8.py).

Documented tolerance, "int8 ~ float": each output of Int8Linear differs from the float Linear's
by at most sum_k |x_k| * scale_n / 2 (every weight is off by at most half its row's scale), which
for Gaussian weights is about 0.3% of the output's size. The kernel path runs in bf16 (the only
dtype the CPU kernel is fast in) and agrees with the reference path to bf16 precision; run in
fp32 the kernel agrees to fp32 precision, which pins down its layout and semantics exactly.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab.quantize.int8 import (
    Int8Linear,
    dequantize_int8,
    int8_kernel_available,
    quantize_int8,
)

needs_kernel = pytest.mark.skipif(not int8_kernel_available(), reason="no _weight_int8pack_mm")
BF16_RTOL = 2.0**-6  # bf16 keeps 8 significant bits: x, scales and the output are each rounded


@settings(max_examples=40, deadline=None)
@given(
    N=st.integers(1, 40), K=st.integers(1, 80), log_std=st.floats(-6, 3), seed=st.integers(0, 99)
)
def test_quantize_error_at_most_half_a_scale(N, K, log_std, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 10**log_std
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (N, K) and scales.shape == (N,)
    assert q.abs().max() <= 127
    err = (dequantize_int8(q, scales) - w).abs()  # (N, K)
    # half a scale, plus fp32 rounding of w / scale and q * scale (|q| <= 127 scales)
    assert (err <= scales[:, None] * (0.5 + 128 * torch.finfo(torch.float32).eps)).all()


def test_scale_is_row_max_over_127_and_zero_row_is_exact():
    w = torch.tensor([[1.0, -2.54, 0.5], [0.0, 0.0, 0.0]])
    q, scales = quantize_int8(w)
    assert scales[0].item() == pytest.approx(2.54 / 127)
    assert q[0, 1].item() == -127
    assert torch.equal(dequantize_int8(q, scales)[1], torch.zeros(3))


def _pair(K=96, N=80, bias=True):
    linear = nn.Linear(K, N, bias=bias)
    return linear, Int8Linear.from_linear(linear)


def test_int8_close_to_float_within_documented_bound():
    linear, qlinear = _pair()
    x = torch.randn(4, 7, 96)  # leading dimensions are kept
    with torch.no_grad():
        y, yq = linear(x), qlinear.reference_forward(x)
    bound = x.abs().sum(-1, keepdim=True) * qlinear.scales / 2  # (4, 7, N)
    assert yq.shape == y.shape == (4, 7, 80)
    assert ((yq - y).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    rel = (yq - y).norm() / y.norm()
    assert rel < 0.01  # the typical error is far below the worst case


@needs_kernel
def test_kernel_in_fp32_equals_reference():
    _, qlinear = _pair()
    x = torch.randn(3, 5, 96)
    ref = qlinear.reference_forward(x)
    torch.testing.assert_close(qlinear.kernel_forward(x, torch.float32), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("N", [80, 65, 1])
def test_kernel_in_bf16_matches_reference(N):
    _, qlinear = _pair(N=N)
    x = torch.randn(2, 9, 96)
    ref = qlinear.reference_forward(x)
    fast = qlinear(x)  # the default path on CPU
    assert fast.dtype == x.dtype
    torch.testing.assert_close(fast, ref, rtol=BF16_RTOL, atol=BF16_RTOL * ref.abs().max().item())


def test_reference_path_when_kernel_is_off():
    _, qlinear = _pair()
    qlinear.use_kernel = False
    x = torch.randn(2, 96)
    assert torch.equal(qlinear(x), qlinear.reference_forward(x))


def test_state_is_int8_weight_scales_and_bias():
    linear, qlinear = _pair()
    sd = qlinear.state_dict()
    assert set(sd) == {"weight", "scales", "bias"}
    assert sd["weight"].dtype == torch.int8 and sd["scales"].dtype == torch.float32
    assert torch.equal(sd["bias"], linear.bias.detach())
    assert list(qlinear.parameters()) == []  # nothing trains
    _, no_bias = _pair(bias=False)
    assert "bias" not in no_bias.state_dict()


def test_load_state_dict_into_meta_module():
    _, qlinear = _pair()
    empty = Int8Linear(96, 80, bias=True, device="meta")
    empty.load_state_dict(qlinear.state_dict(), assign=True)
    x = torch.randn(2, 96)
    assert torch.equal(empty(x), qlinear(x))


@needs_kernel
def test_kernel_safe_for_misaligned_inputs_and_loaded_weights(tmp_path):
    # PyTorch 2.13's multi-row int8 kernel needs aligned operands; Int8Linear ensures them.
    from safetensors.torch import load_file, save_file

    _, qlinear = _pair(K=64, N=64)
    save_file(
        {"pad": torch.zeros(3, dtype=torch.uint8), **qlinear.state_dict()},
        str(tmp_path / "w.safetensors"),
    )
    loaded = load_file(str(tmp_path / "w.safetensors"))
    loaded.pop("pad")
    fresh = Int8Linear(64, 64, bias=True, device="meta")
    fresh.load_state_dict(loaded, assign=True)
    assert fresh.weight.data_ptr() % 64 == 0
    x = torch.randn(1, 20 * 64 + 4, dtype=torch.bfloat16)[:, 4:].view(20, 64)  # 8 bytes off
    ref = qlinear.reference_forward(x.float())
    torch.testing.assert_close(
        fresh(x).float(), ref, rtol=BF16_RTOL, atol=BF16_RTOL * ref.abs().max().item()
    )


@needs_kernel
def test_widths_the_kernel_mishandles_take_the_reference_path():
    _, qlinear = _pair(K=40)
    assert not qlinear.use_kernel
    x = torch.randn(5, 40)
    assert torch.equal(qlinear(x), qlinear.reference_forward(x))


def test_compiled_form_equals_reference():
    _, qlinear = _pair()
    x = torch.randn(1, 1, 96)
    torch.testing.assert_close(
        qlinear.compiled_forward(x), qlinear.reference_forward(x), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, inside inductor
def test_under_torch_compile_one_token_matches_reference():
    _, qlinear = _pair()
    compiled = torch.compile(qlinear)
    for shape in [(1, 1, 96), (2, 3, 96)]:  # one token: the fused form; more: the reference
        x = torch.randn(shape)
        ref = qlinear.reference_forward(x)
        atol = BF16_RTOL * ref.abs().max().item()
        torch.testing.assert_close(compiled(x), ref, rtol=BF16_RTOL, atol=atol)
