"""Initialisation schemes: sample statistics of large layers against each scheme's distribution.

Tolerances come from the sample size: a sample std over N normal draws has standard error
sigma / sqrt(2N), and we allow 6 standard errors (a false alarm about once in 10^9 runs).
"""

import math

import pytest
import torch
from torch import nn

from attnlab.components.init import INIT_SCHEMES, init_weights
from attnlab.components.norms import LayerNorm

N_LAYERS = 6
STD = 0.02
Z = 6.0  # standard errors allowed


class _Block(nn.Module):
    """Large layers with the names the schemes look for (o_proj, down_proj) and some they don't."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(512, 512)
        self.o_proj = nn.Linear(512, 512)
        self.up_proj = nn.Linear(512, 1024)
        self.down_proj = nn.Linear(1024, 512)
        self.norm = LayerNorm(512)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(256, 1000, bias=False)


def _model():
    model = _Model()
    with torch.no_grad():  # start from something no scheme produces
        for p in model.parameters():
            p.fill_(0.7)
    return model


def _assert_std(w: torch.Tensor, sigma: float):
    n = w.numel()
    assert abs(w.mean().item()) < Z * sigma / math.sqrt(n)
    assert abs(w.std().item() - sigma) < Z * sigma / math.sqrt(2 * n), (w.std().item(), sigma)


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_gpt2_scheme():
    model = _model()
    init_weights(model, "gpt2", N_LAYERS)
    residual_std = STD / math.sqrt(2 * N_LAYERS)
    for name, linear in _linears(model):
        expected = residual_std if name.endswith(("o_proj", "down_proj")) else STD
        _assert_std(linear.weight, expected)
        if linear.bias is not None:
            assert (linear.bias == 0).all(), name
    _assert_std(model.embed.weight, STD)
    for block in model.blocks:  # norms untouched: weight one, bias zero is their own init
        assert (block.norm.weight == 0.7).all() and (block.norm.bias == 0.7).all()


def test_gpt2_scheme_custom_std():
    model = _model()
    init_weights(model, "gpt2", n_layers=2, std=0.05)
    _assert_std(model.blocks[0].q_proj.weight, 0.05)
    _assert_std(model.blocks[0].down_proj.weight, 0.05 / 2)


def test_xavier_scheme():
    model = _model()
    init_weights(model, "xavier", N_LAYERS)
    for name, linear in _linears(model):
        fan_out, fan_in = linear.weight.shape
        bound = math.sqrt(6 / (fan_in + fan_out))  # Glorot & Bengio 2010, eq. 16
        w = linear.weight
        assert w.abs().max() <= bound, name
        assert w.abs().max() > 0.99 * bound, name  # and fills the interval
        # U(-b, b): variance b^2 / 3 = 2 / (fan_in + fan_out); the sample variance of N uniform
        # draws has standard error b^2 * sqrt(4 / 45 / N).
        var, n = w.var().item(), w.numel()
        assert abs(var - 2 / (fan_in + fan_out)) < Z * bound**2 * math.sqrt(4 / 45 / n), name
        if linear.bias is not None:
            assert (linear.bias == 0).all(), name
    _assert_std(model.embed.weight, 256**-0.5)


def test_trunc_normal_scheme():
    model = _model()
    init_weights(model, "trunc_normal", N_LAYERS)
    # N(0, s) truncated to [-2s, 2s] has std s * sqrt(1 - 2 * 2 * phi(2) / (Phi(2) - Phi(-2))).
    phi2 = math.exp(-2) / math.sqrt(2 * math.pi)
    shrink = math.sqrt(1 - 4 * phi2 / math.erf(2 / math.sqrt(2)))  # about 0.88
    for name, linear in _linears(model):
        s = STD / math.sqrt(2 * N_LAYERS) if name.endswith(("o_proj", "down_proj")) else STD
        assert linear.weight.abs().max() <= 2 * s, name  # nothing beyond two standard deviations
        _assert_std(linear.weight, s * shrink)
        if linear.bias is not None:
            assert (linear.bias == 0).all(), name
    assert model.embed.weight.abs().max() <= 2 * STD
    _assert_std(model.embed.weight, STD * shrink)


def test_schemes_are_listed():
    assert set(INIT_SCHEMES) == {"gpt2", "xavier", "trunc_normal"}


def test_unknown_scheme_raises_naming_it():
    with pytest.raises(ValueError, match="'kaiming'"):
        init_weights(_model(), "kaiming", N_LAYERS)
