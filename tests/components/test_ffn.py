"""Feed-forward layers against torch modules, F.linear formulas and the GELU closed forms."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.components.ffn import ACTIVATIONS, MLP, GatedMLP, gated_d_ff
from tests.compile_helpers import traced_graphs

C, FF = 16, 40
ATOL = 1e-5  # fp32, max abs difference
TORCH_ACTIVATIONS = {  # the reference module for each of our names
    "relu": nn.ReLU(),
    "gelu": nn.GELU(approximate="none"),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(),
}


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_activations_cover_the_torch_references():
    assert set(ACTIVATIONS) == set(TORCH_ACTIVATIONS)


def test_gelu_exact_and_tanh():
    x = torch.linspace(-6, 6, 1001)
    _close(ACTIVATIONS["gelu"](x), F.gelu(x, approximate="none"))
    _close(ACTIVATIONS["gelu_tanh"](x), F.gelu(x, approximate="tanh"))
    # The closed forms (Hendrycks & Gimpel 2016): x Phi(x), and its tanh approximation.
    _close(ACTIVATIONS["gelu"](x), 0.5 * x * (1 + torch.erf(x / math.sqrt(2))))
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    _close(ACTIVATIONS["gelu_tanh"](x), tanh_form)
    assert (ACTIVATIONS["gelu"](x) - ACTIVATIONS["gelu_tanh"](x)).abs().max() > 1e-5  # distinct


@pytest.mark.slow
def test_gelu_tanh_compiled_is_plain_f_gelu():
    # The core has no compile-only branch: traced, gelu_tanh is F.gelu (the sigmoid form is an
    # accelerator, attnlab/accel/sigmoid_gelu.py).
    with torch.no_grad():
        _, graphs = traced_graphs(ACTIVATIONS["gelu_tanh"], torch.randn(8))
    assert "gelu" in "".join(graphs) and "sigmoid" not in "".join(graphs)


@pytest.mark.parametrize("activation", sorted(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_sequential(activation, bias):
    ours = MLP(C, FF, activation=activation, bias=bias)
    ref = nn.Sequential(
        nn.Linear(C, FF, bias=bias), TORCH_ACTIVATIONS[activation], nn.Linear(FF, C, bias=bias)
    )
    ref.load_state_dict(
        {
            "0.weight": ours.up_proj.weight,
            "2.weight": ours.down_proj.weight,
            **({"0.bias": ours.up_proj.bias, "2.bias": ours.down_proj.bias} if bias else {}),
        }
    )
    x = torch.randn(2, 5, C)
    _close(ours(x), ref(x))


def test_mlp_dropout_only_in_training():
    mlp = MLP(C, FF, dropout=0.5)
    x = torch.randn(2, 5, C)
    expected = mlp.down_proj(F.gelu(mlp.up_proj(x)))
    _close(mlp.eval()(x), expected)
    assert (mlp.train()(x) - expected).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("activation", "gate"),
    [
        ("silu", F.silu),  # SwiGLU
        ("gelu", F.gelu),  # GeGLU
        ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_matches_formula(activation, gate, bias):
    ours = GatedMLP(C, FF, activation=activation, bias=bias)
    g, u, d = ours.gate_proj, ours.up_proj, ours.down_proj
    x = torch.randn(2, 5, C)
    # Shazeer 2020: FFN_SwiGLU(x) = (Swish(x W) * (x V)) W2
    expected = F.linear(
        gate(F.linear(x, g.weight, g.bias)) * F.linear(x, u.weight, u.bias), d.weight, d.bias
    )
    _close(ours(x), expected)


def test_gated_mlp_default_width():
    mlp = GatedMLP(512)
    assert mlp.gate_proj.out_features == mlp.up_proj.out_features == 1408
    assert mlp.down_proj.in_features == 1408


@pytest.mark.parametrize(
    ("d_model", "expected"),
    [
        (512, 1408),
        (768, 2048),
        (4096, 10944),  # 8/3 * 4096 = 10922.7 -> 10944 (Llama-2 rounds to 256: 11008)
    ],
)
def test_gated_d_ff(d_model, expected):
    d_ff = gated_d_ff(d_model)
    assert d_ff == expected
    assert d_ff % 64 == 0
    assert d_ff >= 8 * d_model / 3  # rounded up, never down: at least a 4x MLP's parameters


@pytest.mark.parametrize("cls", [MLP, GatedMLP])
def test_unknown_activation_raises_naming_it(cls):
    with pytest.raises(ValueError, match="'swish2'"):
        cls(C, FF, activation="swish2")
