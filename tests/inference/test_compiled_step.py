"""BoundDecodeStep (compiled without Dynamo's guards) against eager decoding, the reference:
steps made for different models never share a graph, a new input signature gets its own graph,
and another model is refused."""

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from attnlab.inference.compiled_step import compile_decode_step
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate, stream_tokens
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import quantize_model
from tests.compile_helpers import count_unguarded_compiles, needs_compiler

GREEDY = SamplingConfig(temperature=0.0)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    cfg = replace(get_preset("gpt2-tiny"), d_model=32, n_layers=1, vocab_size=64, max_seq_len=32)
    return build_model(replace(cfg, d_ff=64)).eval()


def _compiled_tokens(model, step, prompts, n_new):
    with torch.no_grad():
        return torch.stack(
            list(stream_tokens(model, prompts, GenerationConfig(n_new, GREEDY), step_fn=step)), 1
        )


@pytest.mark.slow
@needs_compiler
def test_steps_of_two_models_and_of_new_shapes_give_the_eager_tokens(monkeypatch):
    unguarded = count_unguarded_compiles(monkeypatch)
    fp32 = _tiny()
    int8 = copy.deepcopy(fp32)
    quantize_model(int8, "int8")  # same module tree, other weight dtypes: another graph
    steps = {m: compile_decode_step(m) for m in (fp32, int8)}
    # alternating models, then a longer prompt and batch 2 (new cache and token shapes)
    for model, prompts, n_new in [
        (fp32, [[1, 2, 3]], 5),
        (int8, [[1, 2, 3]], 5),
        (fp32, [[4, 5, 6, 7, 8]], 7),
        (int8, [[1, 2, 3], [9, 8]], 4),
    ]:
        expected = generate(model, prompts, GenerationConfig(n_new, GREEDY))
        assert _compiled_tokens(model, steps[model], prompts, n_new).tolist() == expected
    assert len(steps[fp32].compiled) == 2 and len(steps[int8].compiled) == 2
    assert len(unguarded) == 4  # every graph without guards, not only each step's first


def test_a_step_refuses_another_model():
    model, other = _tiny(), _tiny()
    step = compile_decode_step(model)
    with pytest.raises(ValueError, match="made for another model"):
        _compiled_tokens(other, step, [[1, 2]], 2)
