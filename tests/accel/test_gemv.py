"""GemvLinear and compile_decode_step against nn.Linear and eager decoding (the references)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.accel.fast_linear import FastLinear
from attnlab.accel.gemv import GemvLinear, use_gemv
from attnlab.accel.swap import rebuild_linear
from attnlab.inference.compiled_step import compile_decode_step
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate, stream_tokens
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.compile_helpers import needs_compiler, traced_graphs

GREEDY = SamplingConfig(temperature=0.0)


def _tiny(preset: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = replace(get_preset(preset), d_model=32, n_layers=1, vocab_size=64, max_seq_len=32)
    return build_model(replace(cfg, d_ff=64)).eval()


def test_use_gemv_swaps_in_new_modules_that_share_the_parameters():
    model = _tiny("gpt2-tiny")  # tied head: the embedding and the head share one Parameter
    ffn = model.blocks[0].ffn
    ffn.up_proj = rebuild_linear(ffn.up_proj, FastLinear)  # a subclass keeps its own forward
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        before, keys = model(ids), list(model.state_dict())
    params = dict(model.named_parameters())
    old = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    assert use_gemv(model) == len(old) > 0
    assert type(model.blocks[0].ffn.up_proj) is FastLinear
    assert type(model.head) is GemvLinear and model.head.weight is model.embed.weight
    for name, m in old.items():  # a new object in each place; the old one keeps its class
        assert type(m) is nn.Linear and type(model.get_submodule(name)) is GemvLinear
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # eager: F.linear, bit for bit


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_one_row_gemv_equals_f_linear(bias):
    torch.manual_seed(0)
    layer = GemvLinear(48, 40, bias=bias)
    compiled = torch.compile(layer)
    with torch.no_grad():
        for x in (torch.randn(1, 48), torch.randn(1, 1, 48), torch.randn(3, 48)):  # GEMV, GEMM
            expected = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_compiled_decoding_gives_the_eager_tokens(preset):
    model = _tiny(preset)
    prompts = [[1, 2, 3, 4, 5]]  # batch 1: each decode step's Linears are GEMVs
    eager = generate(model, prompts, GenerationConfig(6, GREEDY))
    torch._dynamo.reset()
    step = compile_decode_step(model, fullgraph=True)  # a graph break would raise
    with torch.no_grad():
        tokens = list(stream_tokens(model, prompts, GenerationConfig(6, GREEDY), step_fn=step))
    assert torch.stack(tokens, 1).tolist() == eager


@pytest.mark.slow
@pytest.mark.parametrize("rows, form", [(1, "gemv"), (4, "linear")])
def test_the_traced_graph_has_the_gemv_form_for_one_row_only(rows, form):
    with torch.no_grad():
        _, (graph,) = traced_graphs(GemvLinear(16, 8), torch.randn(rows, 16))
    assert ("sum" in graph and "linear" not in graph) == (form == "gemv")
    assert ("linear" in graph) == (form == "linear")
