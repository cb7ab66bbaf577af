"""The sigmoid form of GPT-2's GELU against F.gelu(approximate="tanh") (the reference)."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.accel.sigmoid_gelu import gelu_tanh_sigmoid, use_sigmoid_gelu
from attnlab.components.ffn import MLP, gelu_tanh
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.compile_helpers import traced_graphs


@pytest.mark.slow
def test_compiled_it_is_the_same_function_in_sigmoid_form():
    # aot_eager traces it as inductor would (is_compiling() is True) and runs the traced graph
    # with aten ops: values and gradients must still be F.gelu's.
    x = torch.linspace(-8, 8, 2001, requires_grad=True)
    compiled = torch.compile(gelu_tanh_sigmoid, backend="aot_eager", fullgraph=True)
    ours = compiled(x)
    (grad,) = torch.autograd.grad(ours.sum(), x)
    ref = F.gelu(x, approximate="tanh")
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=2e-6)  # a few fp32 ulps
    torch.testing.assert_close(grad, ref_grad, atol=2e-6, rtol=2e-6)
    with torch.no_grad():
        _, graphs = traced_graphs(gelu_tanh_sigmoid, torch.randn(8))
    assert "sigmoid" in "".join(graphs)


def test_eager_it_is_f_gelu():
    x = torch.randn(100)
    assert torch.equal(gelu_tanh_sigmoid(x), F.gelu(x, approximate="tanh"))


def test_the_switch_changes_only_gelu_tanh_ffns():
    model = build_model(get_preset("gpt2-tiny"))  # MLP with gelu_tanh
    ffns = [m for m in model.modules() if isinstance(m, MLP)]
    assert all(m.act is gelu_tanh for m in ffns)  # plain by default
    assert use_sigmoid_gelu(model) == len(ffns) > 0
    assert all(m.act is gelu_tanh_sigmoid for m in ffns)
    assert use_sigmoid_gelu(build_model(get_preset("llama-tiny"))) == 0  # SwiGLU: untouched
