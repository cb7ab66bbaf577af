"""The paged KV cache against the static one (components/kv_cache.py), the reference it must match:
the same attention outputs and logits, within 1e-5, whatever the block size, the lengths of the
rows, or the fragmentation of the pool (blocks of a sequence are not contiguous)."""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.attention import Attention
from attnlab.components.context import AttentionContext
from attnlab.components.kv_cache import KVCache
from attnlab.components.masks import cached_attention_mask
from attnlab.components.paged_kv_cache import (
    BlockAllocator,
    NoFreeBlocks,
    PagedKVCache,
    row_groups,
)
from attnlab.inference.steps import decode_step, fill_cache, left_pad
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

C = 16  # d_model of the attention-level tests


def fragment(cache: PagedKVCache, rng: random.Random) -> None:
    """Leave the free list out of order: allocate a few dummy sequences, free every other one."""
    for i in range(4):
        cache.add(f"dummy{i}")
        cache.reserve(f"dummy{i}", rng.randint(1, 2 * cache.block_size))
    for i in (0, 2):
        cache.free(f"dummy{i}")


@settings(max_examples=30, deadline=None)
@given(
    n_kv=st.sampled_from([1, 2, 4]),
    block_size=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    steps=st.integers(0, 4),
    seed=st.integers(0, 1000),
    group_cost=st.sampled_from([0, 16]),
)
def test_paged_attention_equals_static(n_kv, block_size, lengths, steps, seed, group_cost):
    """Prefill rows of different lengths and decode a few tokens: every output of an Attention
    layer (MHA, GQA, MQA) over the paged cache equals the one over a left-padded static cache,
    with rows attending in one group or (group_cost 0) in one group per distinct length."""
    torch.manual_seed(seed)
    attn = Attention(C, n_heads=4, n_kv_heads=n_kv).eval()
    B, T0 = len(lengths), max(lengths)
    x = torch.randn(B, T0 + steps, C)  # row b's tokens: x[b, T0 - len_b :] (left padded)
    key_valid = torch.ones(B, T0 + steps, dtype=torch.bool)
    for b, n in enumerate(lengths):
        key_valid[b, : T0 - n] = False

    # Reference: the static cache, all rows at once, left padding masked.
    static = KVCache(B, n_kv, T0 + steps, attn.head_dim)
    want = []
    with torch.no_grad():
        for lo, hi in [(0, T0)] + [(T0 + i, T0 + i + 1) for i in range(steps)]:
            slots = torch.arange(lo, hi)
            mask = cached_attention_mask(slots, key_valid, None)
            want.append(attn(x[:, lo:hi], AttentionContext(mask=mask, slots=slots), static))

    # Paged: each row prefilled on its own, then every decode step batched.
    decoder = SimpleNamespace(
        embed=torch.nn.Embedding(1, C), blocks=[SimpleNamespace(self_attn=attn)]
    )
    cache = PagedKVCache(decoder, n_blocks=64, block_size=block_size, group_cost=group_cost)
    fragment(cache, random.Random(seed))
    with torch.no_grad():
        for b, n in enumerate(lengths):
            cache.add(b)
            step = cache.step([b], [0], n)
            ctx = AttentionContext(mask=step.attention_mask(), slots=step.slots)
            got = attn(x[b : b + 1, T0 - n : T0], ctx, step.layers[0])
            torch.testing.assert_close(got[0], want[0][b, T0 - n :], atol=1e-5, rtol=1e-5)
        for i in range(steps):
            step = cache.step(list(range(B)), [n + i for n in lengths], 1)
            ctx = AttentionContext(mask=step.attention_mask(), slots=step.slots)
            got = attn(x[:, T0 + i : T0 + i + 1], ctx, step.layers[0])
            torch.testing.assert_close(got, want[1 + i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "alibi"])
@pytest.mark.parametrize("block_size,group_cost", [(1, 16), (3, 16), (16, 16), (1, 0), (3, 0)])
def test_paged_model_logits_equal_static(preset, block_size, group_cost):
    """A whole decoder (RoPE + GQA, learned positions, or ALiBi's per-row bias) gives the same
    logits over both caches: prefill of each prompt alone, then batched decode steps at each
    row's own position, the rows in one group or (group_cost 0) split by length."""
    if preset == "alibi":
        cfg = replace(get_preset("gpt2-tiny"), position="alibi")
    else:
        cfg = get_preset(preset)
    model = build_model(cfg).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    ids, mask = left_pad(prompts)
    cache = PagedKVCache(model, n_blocks=40, block_size=block_size, group_cost=group_cost)
    fragment(cache, random.Random(block_size))
    with torch.no_grad():
        want, static, slot = fill_cache(model, ids, mask, room=5)
        for b, p in enumerate(prompts):
            cache.add(b)
            step = cache.step([b], [0], len(p))
            got = model(torch.tensor([p]), cache=step, slots=step.slots, last_only=True)[:, -1]
            torch.testing.assert_close(got[0], want[b], atol=1e-5, rtol=1e-5)
        lengths = [len(p) for p in prompts]
        token = torch.tensor([[3], [4], [5]])
        for i in range(5):
            want = decode_step(model, token, torch.tensor([slot + i]), static)  # (B, V)
            step = cache.step([0, 1, 2], [n + i for n in lengths], 1)
            if group_cost == 0 and block_size == 1:
                assert len(step.groups) == 3  # every row attends on its own
            got = model(token, cache=step, slots=step.slots)[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            token = want.argmax(-1, keepdim=True)


def all_splits(n: int):
    """Every way to cut 0 .. n-1 into consecutive runs (as lists of run ends)."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in all_splits(n - first):
            yield [first] + [first + r for r in rest]


@settings(max_examples=60, deadline=None)
@given(
    n_blocks=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    group_cost=st.integers(0, 40),
)
def test_row_groups_is_the_cheapest_split(n_blocks, group_cost):
    """row_groups covers every row once, and its cost equals the minimum over every split of
    the length-sorted rows into consecutive runs (brute force)."""
    groups = row_groups(n_blocks, group_cost)
    assert sorted(r for g in groups for r in g) == list(range(len(n_blocks)))

    def cost(runs):
        return sum(len(g) * max(n_blocks[r] for r in g) + group_cost for g in runs)

    length = sorted(n_blocks)
    best = min(
        sum((end - start) * length[end - 1] + group_cost for start, end in zip([0] + ends, ends))
        for ends in all_splits(len(length))
    )
    assert cost(groups) == best


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_paged_sliding_window_equals_static(preset):
    """A sliding-window model (Mistral-style; Gemma's windowed layers between global ones, with
    their own RoPE base in Gemma 3) masks the same keys over both caches."""
    cfg = get_preset(preset)
    cfg = replace(cfg, attention=replace(cfg.attention, sliding_window=4))
    model = build_model(cfg).eval()
    prompt = list(range(1, 10))
    cache = PagedKVCache(model, n_blocks=8, block_size=3)
    cache.add("a")
    with torch.no_grad():
        want = model(torch.tensor([prompt]))[0]  # (T, V), no cache at all
        step = cache.step(["a"], [0], 6)
        got = model(torch.tensor([prompt[:6]]), cache=step, slots=step.slots)[0]
        step = cache.step(["a"], [6], 3)
        got = torch.cat([got, model(torch.tensor([prompt[6:]]), cache=step, slots=step.slots)[0]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_blocks_are_allocated_as_sequences_grow_and_freed():
    model = build_model(get_preset("gpt2-tiny"))
    cache = PagedKVCache(model, n_blocks=5, block_size=4)
    cache.add("a")
    cache.step(["a"], [0], 5)  # 5 tokens: 2 blocks
    assert len(cache.tables["a"]) == 2 and cache.n_free == 3
    cache.step(["a"], [5], 1)  # position 5 still in block 1
    assert cache.n_free == 3
    cache.add("b")
    cache.step(["b"], [0], 12)  # 3 blocks: the pool is full
    assert cache.n_free == 0
    with pytest.raises(NoFreeBlocks, match="a step needs 2 more KV blocks, 0 are free"):
        cache.step(["a", "b"], [8, 12], 1)
    assert len(cache.tables["a"]) == 2, "a failed step allocates nothing"
    cache.free("a")
    cache.free("b")
    assert cache.n_free == 5 and not cache.tables


def test_prefix_index_shares_whole_prefixes_and_grows_with_blocks_only():
    """A prompt of 40 blocks is matched block by block by a prompt that shares its first 30,
    not at all by one that differs in its first token, nor past a block that was taken back;
    its index holds each block's own tokens (40 * 4 ids), not every token up to each block's
    end (4 + 8 + ... + 160 = 3280)."""
    model = build_model(get_preset("gpt2-tiny"))
    cache = PagedKVCache(model, n_blocks=100, block_size=4)
    prompt = list(range(1, 161))  # 40 full blocks
    cache.add("a")
    cache.step(["a"], [0], len(prompt))
    cache.register_prefix("a", prompt, len(prompt))
    assert sum(len(tokens) for _, tokens in cache.prefixes) == 40 * 4
    cache.free("a")  # its blocks stay cached
    cache.add("b")
    assert cache.match_prefix("b", prompt[:120] + [0] * 20) == 120
    cache.add("c")
    assert cache.match_prefix("c", [0] + prompt[1:]) == 0
    cache.add("d")
    assert cache.match_prefix("d", prompt, salt=(("adapter", 1),)) == 0, "another adapter's"
    cache.free("b")
    cache.free("c")
    cache.free("d")
    block_5 = cache.prefixes[next(k for k in cache.prefixes if k[1] == tuple(prompt[20:24]))][0]
    cache.allocator.cached.move_to_end(block_5, last=False)  # the least recently used
    cache.add("e")
    cache.reserve("e", 4)  # one block: the least recently cached before any never used
    cache.add("f")
    assert cache.match_prefix("f", prompt) == 20, "blocks 0-4 only: block 5 was taken back"


def test_a_block_used_before_is_taken_before_one_never_used():
    """Freed blocks, then cached ones (least recent first), then never-used ones: the pool's
    touched memory grows to what sequences needed at once, not with every prefix cached."""
    allocator = BlockAllocator(6)
    a, b, c = allocator.allocate(), allocator.allocate(), allocator.allocate()
    assert (a, b, c) == (0, 1, 2)
    allocator.release(a, keep=True)  # cached: 0, then 2
    allocator.release(c, keep=True)
    allocator.release(b)  # free: 1
    assert [allocator.allocate() for _ in range(6)] == [1, 0, 2, 3, 4, 5]
    with pytest.raises(NoFreeBlocks):
        allocator.allocate()


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="n_blocks must be >= 1, got 0"):
        BlockAllocator(0)
    model = build_model(get_preset("gpt2-tiny"))
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        PagedKVCache(model, 4, 0)
    with pytest.raises(ValueError, match="MLA"):
        PagedKVCache(build_model(get_preset("mla-tiny")), 4, 4)
