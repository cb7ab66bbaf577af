"""inference/steering.py: steered generation with the KV cache equals recomputing the whole
sequence with the same steering at every step; the vector lands where it is asked for."""

from dataclasses import replace

import pytest
import torch

from attnlab.components.hooks import run_with_cache
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steering import Steer, difference_vector, parse_steer, steering
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

# Learned positions; RoPE with GQA (4 heads on 2 kv heads); ALiBi.
MODELS = {
    "gpt2": ("gpt2-tiny", {}),
    "llama": ("llama-tiny", {}),
    "alibi": ("llama-tiny", {"position": "alibi"}),
}
PROMPT = [5, 17, 30, 44, 9, 12]
NEW = 12


def tiny(name):
    preset, changes = MODELS[name]
    torch.manual_seed(0)
    return build_model(replace(get_preset(preset), **changes)).eval()


@torch.no_grad()
def recomputed(model, prompt, n):
    """Greedy decoding with no cache: a whole-sequence forward for every new token."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))  # (1, T, V)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_steered_generation_equals_recomputation(name):
    model = tiny(name)
    greedy = GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(temperature=0))
    vector = difference_vector(model, [3, 4, 5], [60, 61], layer=1)
    steers = [Steer(1, vector, 8.0), Steer(0, torch.randn(64), 2.0)]
    plain = generate(model, [PROMPT], greedy)[0]
    with steering(model, steers):
        cached = generate(model, [PROMPT], greedy)[0]
        uncached = recomputed(model, PROMPT, NEW)
    assert cached == uncached
    assert cached != plain  # the steering changes the text (the test would see a no-op)
    assert generate(model, [PROMPT], greedy)[0] == plain  # and is gone after the block


def test_the_vector_is_added_at_its_layer_only():
    model = tiny("llama")
    ids = torch.tensor([PROMPT])
    names = [f"blocks.{i}.hook_resid_pre" for i in range(2)]
    _, before = run_with_cache(model, ids, names=names)
    v = torch.randn(64)
    with steering(model, [Steer(-1, v, 3.0)]):  # -1: the last block
        _, after = run_with_cache(model, ids, names=names)
    assert torch.equal(after["blocks.0.hook_resid_pre"], before["blocks.0.hook_resid_pre"])
    # the cache keeps the point's last hook's view: run_with_cache's hook runs after the steer
    assert torch.allclose(
        after["blocks.1.hook_resid_pre"], before["blocks.1.hook_resid_pre"] + 3 * v
    )


def test_difference_vector_is_the_mean_activation_difference():
    model = tiny("gpt2")
    a, b = [3, 4, 5], [60, 61]
    point = "blocks.1.hook_resid_pre"
    ca = run_with_cache(model, torch.tensor([a]), names=[point])[1][point][0]
    cb = run_with_cache(model, torch.tensor([b]), names=[point])[1][point][0]
    expected = ca.mean(0) - cb.mean(0)
    assert torch.allclose(difference_vector(model, a, b, 1), expected)


def test_bad_steering_is_one_clear_error():
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="outside this model's 2 blocks"):
        with steering(model, [Steer(5, torch.zeros(64))]):
            pass
    with pytest.raises(ValueError, match=r"give \(64,\)"):
        with steering(model, [Steer(0, torch.zeros(32))]):
            pass
    with pytest.raises(ValueError, match="LAYER"):
        parse_steer(["six", "a", "b", "4"])
    assert parse_steer(["6", " Love", " Hate", "4"]) == (6, " Love", " Hate", 4.0)
