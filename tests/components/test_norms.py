"""LayerNorm and RMSNorm against torch.nn.LayerNorm / nn.RMSNorm with copied random weights."""

import pytest
import torch
from torch import nn

from attnlab.components.norms import (
    LayerNorm,
    RMSNorm,
    build_norm,
    layer_norm_reference,
    rms_norm_reference,
)

C = 48
ATOL = 1e-5  # fp32, max abs difference
BF16_RTOL = 2**-7  # one bf16 ulp: the rounding of the output, plus a possible flip of its last bit


def _close(actual, expected, atol=ATOL, rtol=0.0):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def _pair(kind: str, bias: bool = True, eps: float = 1e-5):
    """(ours, torch's) with the same random affine parameters."""
    if kind == "layernorm":
        ref, ours = nn.LayerNorm(C, eps=eps, bias=bias), LayerNorm(C, eps=eps, bias=bias)
    else:
        ref, ours = nn.RMSNorm(C, eps=eps), RMSNorm(C, eps=eps)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()  # the defaults (ones, zeros) would hide a weight or bias that is ignored
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _x(dtype=torch.float32):
    return (3.0 * torch.randn(2, 5, C) + 1.5).to(dtype)  # off-centre, not unit scale


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_layernorm_matches_torch(bias, eps):
    ours, ref = _pair("layernorm", bias, eps)
    assert (ours.bias is None) == (not bias)
    x = _x()
    _close(ours(x), ref(x))


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_torch(eps):
    ours, ref = _pair("rmsnorm", eps=eps)
    x = _x()
    _close(ours(x), ref(x))


def test_rmsnorm_epsilon_is_inside_the_root():
    # A tiny input makes eps dominate, which separates sqrt(ms + eps) from sqrt(ms) + eps.
    ours, ref = _pair("rmsnorm", eps=1e-2)
    x = 1e-3 * torch.randn(3, C)
    _close(ours(x), ref(x))


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("weights_bf16", [False, True])
def test_bf16_input_keeps_dtype_and_matches_fp32_reference(kind, weights_bf16):
    ours, ref = _pair(kind)
    if weights_bf16:  # the whole model cast to bf16: the reference sees the same rounded weights
        ours.to(torch.bfloat16)
        ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    x = _x(torch.bfloat16)
    out = ours(x)
    assert out.dtype == torch.bfloat16
    expected = ref(x.float())  # statistics in fp32 on the bf16 values
    _close(out.float(), expected, atol=1e-6, rtol=BF16_RTOL)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_and_gradients_equal_the_written_formula(kind, dtype):
    ours, _ = _pair(kind)
    x = _x(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = ours.weight.detach().clone().requires_grad_()
    if kind == "layernorm":
        b_ref = ours.bias.detach().clone().requires_grad_()
        expected = layer_norm_reference(x_ref, w_ref, b_ref, ours.eps)
        ref_params, params = (w_ref, b_ref), (ours.weight, ours.bias)
    else:
        expected = rms_norm_reference(x_ref, w_ref, ours.eps)
        ref_params, params = (w_ref,), (ours.weight,)
    out = ours(x)
    assert out.dtype == expected.dtype == dtype
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=BF16_RTOL)
    _close(out.float(), expected.float(), **tol)
    _close(x.grad.float(), x_ref.grad.float(), **tol)
    for p, p_ref in zip(params, ref_params):
        _close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_output_has_the_input_shape(kind):
    norm = build_norm(kind, C, 1e-5)
    for shape in [(C,), (3, C), (2, 3, 4, C)]:
        assert norm(torch.randn(shape)).shape == shape


def test_build_norm_by_name():
    assert isinstance(build_norm("layernorm", C, 1e-5), LayerNorm)
    assert build_norm("layernorm", C, 1e-5, bias=False).bias is None
    assert isinstance(build_norm("rmsnorm", C, 1e-6), RMSNorm)
    with pytest.raises(ValueError, match="'batchnorm'"):
        build_norm("batchnorm", C, 1e-5)
