"""short_attention against the plain path (SDPA through the core's Attention): the same
outputs and gradients, compiled or not; written out only where it was asked for."""

import pytest
import torch

from attnlab.accel.short_attention import SHORT_KEYS_CPU, use_short_attention
from attnlab.components.attention import Attention
from attnlab.components.context import AttentionContext
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.compile_helpers import traced_graphs

CAUSAL = AttentionContext(is_causal=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "T, sdpa_in_graph",
    [(1, False), (SHORT_KEYS_CPU, False), (SHORT_KEYS_CPU + 1, True)],
)
def test_compiled_attention_is_written_out_for_one_query_or_short_sequences(T, sdpa_in_graph):
    # Inside torch.compile on CPU: one query, or at most SHORT_KEYS_CPU keys, take the written-
    # out form; longer ones SDPA. Outputs and gradients equal the plain module's (SDPA) either way.
    plain = Attention(d_model=16, n_heads=2)  # sdpa backend
    fast = Attention(d_model=16, n_heads=2)
    fast.load_state_dict(plain.state_dict())
    assert use_short_attention(fast) == 1
    x = torch.randn(2, T, 16, requires_grad=True)
    out, graphs = traced_graphs(fast, x, CAUSAL)
    expected = plain(x, CAUSAL)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    grad_y = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *fast.parameters()], grad_y)
    want = torch.autograd.grad(expected, [x, *plain.parameters()], grad_y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert ("scaled_dot_product_attention" in "".join(graphs)) == sdpa_in_graph


def test_eager_outputs_are_the_plain_models():
    torch.manual_seed(0)
    model = build_model(get_preset("gpt2-tiny")).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        before = model(ids)
        n = use_short_attention(model)
        assert n == len(model.blocks)
        assert torch.equal(model(ids), before)  # outside torch.compile: SDPA itself


def test_eager_layers_stay_eager():
    attn = Attention(16, 2, backend="eager")
    assert use_short_attention(attn) == 0 and attn.backend == "eager"


def test_plain_models_run_the_configured_backend():
    model = build_model(get_preset("llama-tiny"))
    assert {m.backend for m in model.modules() if isinstance(m, Attention)} == {"sdpa"}
