"""The compiled paged decode attention against SDPA on the gathered keys (the reference), and a
whole decoder's batched decode steps with it against the plain paged path and the static cache."""

import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from attnlab.accel.paged_attention import paged_decode_attention, use_compiled_decode
from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.inference.steps import decode_step, fill_cache, left_pad
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.compile_helpers import needs_compiler


def reference(q, k_pool, v_pool, key_slots, mask, bias, scale):
    """Gather each row's keys, then SDPA (GQA by repeating kv heads)."""
    B, H = q.shape[:2]
    k = k_pool[key_slots].transpose(1, 2)  # (B, K, S, D)
    v = v_pool[key_slots].transpose(1, 2)
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores_mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    if bias is not None:
        scores_mask = scores_mask + bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=scores_mask, scale=scale)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_attention_equals_sdpa(n_heads, n_kv, with_bias):
    """The written-out form (run eagerly here) equals SDPA over the gathered keys: MHA, GQA,
    MQA, rows of different lengths (masked), with and without a score bias."""
    torch.manual_seed(0)
    B, S, D, n_slots = 3, 12, 8, 40
    q = torch.randn(B, n_heads, 1, D)
    k_pool, v_pool = torch.randn(n_slots, n_kv, D), torch.randn(n_slots, n_kv, D)
    key_slots = torch.stack([torch.randperm(n_slots)[:S] for _ in range(B)])
    lengths = torch.tensor([12, 5, 1])
    mask = (torch.arange(S) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    bias = torch.randn(B, n_heads, 1, S) if with_bias else None
    want = reference(q, k_pool, v_pool, key_slots, mask, bias, None)
    got = paged_decode_attention(q, k_pool, v_pool, key_slots, mask, bias, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = paged_decode_attention(q, k_pool, v_pool, key_slots, mask, bias, 1.0)
    want = reference(q, k_pool, v_pool, key_slots, mask, bias, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, reference(q, k_pool, v_pool, key_slots, mask, bias, 0.5))
    assert math.isfinite(got.abs().max().item())


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_compiled_decode_steps_equal_the_static_cache(position):
    """A decoder with GQA (RoPE, or ALiBi's bias) decoding 3 rows of different lengths in
    batched steps through the compiled kernel gives the static cache's logits within 1e-5, with
    the rows in one group and split by length, and its cache's steps do call the kernel."""
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), position=position)
    model = build_model(cfg).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]
    ids, mask = left_pad(prompts)
    for group_cost in (16, 0):
        cache = PagedKVCache(model, n_blocks=40, block_size=2, group_cost=group_cost)
        attn = model.blocks[0].self_attn
        use_compiled_decode(cache, attn.n_heads, attn.scale)
        calls = []

        def counted(*args, kernel=cache.decode_attention, calls=calls):
            calls.append(1)
            return kernel(*args)

        cache.decode_attention = counted
        order = list(range(3))
        random.Random(group_cost).shuffle(order)  # rows in any order
        with torch.no_grad():
            want, static, slot = fill_cache(model, ids, mask, room=4)
            for b in order:
                cache.add(b)
                step = cache.step([b], [0], len(prompts[b]))
                model(torch.tensor([prompts[b]]), cache=step, slots=step.slots, last_only=True)
            token = torch.tensor([[3], [4], [5]])
            for i in range(4):
                want = decode_step(model, token, torch.tensor([slot + i]), static)  # (B, V)
                step = cache.step([0, 1, 2], [len(p) + i for p in prompts], 1)
                got = model(token, cache=step, slots=step.slots)[:, -1]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                token = want.argmax(-1, keepdim=True)
        n_groups = len(step.groups)
        assert len(calls) == 4 * cfg.n_layers * n_groups and (group_cost > 0 or n_groups > 1)
