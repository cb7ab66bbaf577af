"""The engine's decode step as one compiled graph (accel/paged_step.py) against the references:
the static cache's decode steps (components/kv_cache.py) for its logits, and `generate` for the
engine's tokens."""

from dataclasses import replace

import pytest
import torch

from attnlab.accel.paged_step import CompiledPagedDecode, decode_logits
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.inference.steps import decode_step, fill_cache, left_pad
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.types import EngineConfig, Request, SamplingParams
from tests.compile_helpers import count_unguarded_compiles, needs_compiler
from tests.serve.test_engine import alone, run


def static_and_paged(model, prompts, block_size=2):
    """The prompts prefilled into a static cache and into a paged pool (one sequence each)."""
    ids, mask = left_pad(prompts)
    _, static, slot = fill_cache(model, ids, mask, room=4)
    cache = PagedKVCache(model, n_blocks=60, block_size=block_size)
    for b, prompt in enumerate(prompts):
        cache.add(b)
        step = cache.step([b], [0], len(prompt))
        model(torch.tensor([prompt]), cache=step, slots=step.slots, last_only=True)
    return static, slot, cache


@pytest.mark.parametrize("preset,position", [("llama-tiny", "rope"), ("gpt2-tiny", None)])
def test_pool_step_logits_equal_the_static_cache(preset, position):
    """decode_logits, run eagerly (what the graph computes): 3 rows of different lengths, 4
    steps, the static cache's logits within 1e-5 (RoPE with GQA; GPT-2's learned positions)."""
    torch.manual_seed(0)
    cfg = get_preset(preset)
    cfg = cfg if position is None else replace(cfg, position=position)
    model = build_model(cfg).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]
    with torch.no_grad():
        static, slot, cache = static_and_paged(model, prompts)
        pools = [layer.slots_view() for layer in cache.layers]
        token = torch.tensor([[3], [4], [5]])
        for i in range(4):
            want = decode_step(model, token, torch.tensor([slot + i]), static)  # (B, V)
            step = cache.step([0, 1, 2], [len(p) + i for p in prompts], 1)
            got = decode_logits(model, pools, token, step.key_slots, step.slots, step.pos)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            token = want.argmax(-1, keepdim=True)


def test_a_quantized_pool_is_refused_in_one_line():
    model = build_model(get_preset("llama-tiny")).eval()
    cache = PagedKVCache(model, n_blocks=8, block_size=4, dtype=torch.int8)
    with pytest.raises(ValueError, match="reads a float KV pool"):
        CompiledPagedDecode(model, cache)


@pytest.mark.slow
@needs_compiler
def test_an_engine_with_the_compiled_step_gives_generates_tokens(monkeypatch):
    """An engine whose decode steps run compiled: requests alone (one row) and together (up to
    four rows, of different lengths, joining and leaving) give `generate`'s greedy tokens, and
    its steps' logits equal the static cache's within 1e-5."""
    unguarded = count_unguarded_compiles(monkeypatch)
    torch.manual_seed(0)
    model = build_model(replace(get_preset("llama-tiny"), position="rope")).eval()
    config = EngineConfig(block_size=4, max_context=128, compile_decode=True)
    engine = Engine(model, None, config)
    assert isinstance(engine.compiled_decode, CompiledPagedDecode)
    requests = [
        Request(f"r{i}", tuple(range(1 + i, 4 + 5 * i)), SamplingParams(6 + 3 * i, 0.0))
        for i in range(4)
    ]
    got, _ = run(engine, requests[:1])
    got, most = run(engine, requests[1:], got)
    assert most == 3
    assert len(unguarded) == 2  # the warm-up compiled both forms, neither with guards
    for r in requests:
        assert got.tokens(r.request_id) == alone(model, r)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]
    with torch.no_grad():
        static, slot, cache = static_and_paged(model, prompts, block_size=4)
        compiled = CompiledPagedDecode(model, cache)
        token = torch.tensor([[3], [4], [5]])
        for i in range(3):
            want = decode_step(model, token, torch.tensor([slot + i]), static)
            step = cache.step([0, 1, 2], [len(p) + i for p in prompts], 1)
            torch.testing.assert_close(compiled(token, step), want, atol=1e-5, rtol=1e-5)
            token = want.argmax(-1, keepdim=True)


def test_the_engine_refuses_a_prefix_tuned_model_with_the_compiled_step():
    """The graph runs the base model alone: a prefix-tuned model (its learned prefix written
    into each sequence first) is refused in one line, and an engine without the option has
    no compiled step."""
    base = build_model(get_preset("llama-tiny")).eval()
    tuned = PromptLearningLM(base, "prefix", 4, 8).eval()
    with pytest.raises(ValueError, match="base model alone"):
        Engine(tuned, None, EngineConfig(block_size=4, max_context=64, compile_decode=True))
    assert Engine(base, None, EngineConfig(block_size=4, max_context=64)).compiled_decode is None
