"""Int4 group-wise asymmetric quantization (attnlab/quantize/int4.py).

Packing is a bijection (exact round trips), every weight is within half its group's scale of
its dequantized value, and the fused CPU kernel (in its own blocked layout, built from ours)
computes the same product as dequantize + F.linear: to fp32 precision when run in fp32, to bf16
precision in its fast bf16 mode.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab.quantize.int4 import (
    Int4Linear,
    dequantize_int4,
    int4_kernel_available,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="no int4 CPU kernel")
BF16_RTOL = 2.0**-6


@settings(max_examples=50, deadline=None)
@given(N=st.integers(1, 20), half_K=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_pack_unpack_round_trip_is_exact(N, half_K, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, 2 * half_K), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (N, half_K) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    any_bytes = torch.randint(0, 256, (N, half_K), generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(any_bytes)), any_bytes)  # every byte is a pair


def test_low_nibble_holds_the_even_column():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F]]


@settings(max_examples=30, deadline=None)
@given(
    group_size=st.sampled_from([32, 64, 128]),
    N=st.integers(1, 12),
    groups=st.integers(1, 3),
    shift=st.floats(-5, 5),
    log_std=st.floats(-4, 2),
    seed=st.integers(0, 99),
)
def test_quantize_error_at_most_half_a_scale(group_size, N, groups, shift, log_std, seed):
    gen = torch.Generator().manual_seed(seed)
    K = group_size * groups
    w = torch.randn(N, K, generator=gen) * 10**log_std + shift  # off-centre groups too
    q, scales, mins = quantize_int4(w, group_size)
    assert q.max() <= 15 and scales.shape == mins.shape == (N, groups)
    w_hat = dequantize_int4(pack_int4(q), scales, mins)
    err = (w_hat - w).abs().view(N, groups, group_size)
    tol = scales[..., None] / 2 + 4 * torch.finfo(torch.float32).eps * w.abs().max()  # rounding
    assert (err <= tol).all()


def test_group_min_and_max_are_exact_levels():
    w = torch.randn(4, 64)
    q, scales, mins = quantize_int4(w, 32)
    groups = w.view(4, 2, 32)
    torch.testing.assert_close(mins, groups.amin(-1))
    assert (q.view(4, 2, 32).amax(-1) == 15).all() and (q.view(4, 2, 32).amin(-1) == 0).all()
    constant = torch.full((2, 32), 0.75)
    assert torch.equal(
        dequantize_int4(
            pack_int4(quantize_int4(constant, 32)[0]), *quantize_int4(constant, 32)[1:]
        ),
        constant,
    )


@pytest.mark.parametrize("group_size, K", [(16, 64), (32, 48), (48, 96)])
def test_bad_group_size_raises(group_size, K):
    with pytest.raises(ValueError, match=f"group_size={group_size}.*in_features={K}"):
        quantize_int4(torch.randn(4, K), group_size)
    with pytest.raises(ValueError, match=f"group_size={group_size}"):
        Int4Linear(K, 4, group_size=group_size)


def _pair(K=128, N=80, bias=True, group_size=32):
    linear = nn.Linear(K, N, bias=bias)
    return linear, Int4Linear.from_linear(linear, group_size)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_close_to_float(group_size):
    linear, qlinear = _pair(group_size=group_size)
    x = torch.randn(3, 128)
    with torch.no_grad():
        y = linear(x)
    yq = qlinear.reference_forward(x)
    bound = x.abs().sum(-1, keepdim=True) * qlinear.scales.max(-1).values / 2
    assert ((yq - y).abs() <= bound * (1 + 1e-5)).all()


@needs_kernel
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("N", [80, 65])  # 65: rows padded to a multiple of 16 for the kernel
def test_kernel_in_fp32_equals_reference(group_size, N):
    _, qlinear = _pair(N=N, group_size=group_size)
    x = torch.randn(2, 5, 128)
    ref = qlinear.reference_forward(x)
    torch.testing.assert_close(qlinear.kernel_forward(x, torch.float32), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("N", [80, 65])
def test_kernel_in_bf16_matches_reference(N):
    _, qlinear = _pair(N=N)
    x = torch.randn(2, 5, 128)
    ref = qlinear.reference_forward(x)
    fast = qlinear(x)
    assert fast.shape == ref.shape and fast.dtype == x.dtype
    torch.testing.assert_close(fast, ref, rtol=BF16_RTOL, atol=BF16_RTOL * ref.abs().max().item())


@needs_kernel
def test_loading_new_weights_rebuilds_the_kernel_layout():
    _, a = _pair()
    _, b = _pair()
    x = torch.randn(2, 128)
    a(x)  # builds a's kernel layout
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), b(x))


def test_state_is_packed_weight_scales_mins():
    _, qlinear = _pair(bias=False)
    sd = qlinear.state_dict()
    assert set(sd) == {"weight", "scales", "mins"}  # the kernel layout is never saved
    assert sd["weight"].shape == (80, 64) and sd["weight"].dtype == torch.uint8
    assert sd["scales"].shape == (80, 4)
