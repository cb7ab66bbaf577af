"""A quantized KV cache (int8, fp8 e4m3) is the plain model attending to quantized keys/values.

(1) int8 codes and scales dequantize to what PyTorch's own per-channel fake quantization
    gives (torch.fake_quantize_per_channel_affine, one channel per token and head, symmetric
    in [-127, 127]); fp8 codes to torch's float8_e4m3fn rounding of x / scale, within e4m3's
    2^-4 relative step, the largest entry of each vector at 448
(2) prefill + decode over a quantized cache gives the logits of one uncached forward whose
    keys and values are fake-quantized by hooks (PyTorch's op again): the cache changes which
    numbers attention reads, nothing else
(3) the paged pool quantizes the same way: the batched engine's greedy tokens equal
    `generate`'s over the static quantized cache, request by request
(4) memory: (D + 4) / (4 D) of the fp32 pool's bytes; a latent (MLA) cache and the compiled
    paged attention refuse a quantized cache in one line
"""

import pytest
import torch

from attnlab.components.hooks import hooks
from attnlab.components.kv_cache import (
    KV_CODE_MAX,
    dequantize_kv,
    kv_cache_dtype,
    quantize_kv,
)
from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import decode_step, fill_cache
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.types import EngineConfig, Request, SamplingParams

INT8, FP8 = torch.int8, torch.float8_e4m3fn
GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return build_model(get_preset("llama-tiny")).eval()


def torch_fake_quant(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: each (token, head) vector of x (..., D) quantized by PyTorch's ops."""
    flat = x.reshape(-1, x.shape[-1]).float()
    scale = flat.abs().amax(-1) / KV_CODE_MAX[dtype]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == INT8:
        zero = torch.zeros(flat.shape[0], dtype=torch.int32)
        out = torch.fake_quantize_per_channel_affine(flat, scale, zero, 0, -127, 127)
    else:
        out = (flat / scale[:, None]).to(dtype).float() * scale[:, None]
    return out.view(x.shape)


def test_int8_equals_torch_fake_quantize_per_channel():
    x = torch.randn(2, 3, 7, 16) * torch.rand(2, 3, 7, 1) * 5
    x[0, 0, 0] = 0  # an all-zero vector stays zero
    codes, scale = quantize_kv(x, INT8)
    assert codes.dtype == INT8 and scale.shape == (2, 3, 7, 1)
    assert codes.abs().amax(-1).eq(127).sum() == 2 * 3 * 7 - 1  # each vector's amax at 127
    torch.testing.assert_close(dequantize_kv(codes, scale, INT8), torch_fake_quant(x, INT8))
    assert (dequantize_kv(codes, scale, INT8) - x).abs().le(scale / 2 + 1e-7).all()


def test_fp8_is_e4m3_of_the_scaled_vector():
    x = torch.randn(2, 3, 7, 16) * 3
    codes, scale = quantize_kv(x, FP8)
    assert codes.dtype == torch.uint8  # the bytes of float8_e4m3fn codes
    y = dequantize_kv(codes, scale, FP8)
    torch.testing.assert_close(y, torch_fake_quant(x, FP8), atol=0, rtol=0)
    assert codes.view(FP8).float().abs().amax(-1).eq(448).all()
    # e4m3: 3 mantissa bits, so a normal number rounds within 2^-4 of itself; subnormals
    # (below 2^-6 of the code scale) within half their step, 2^-10
    err = (y - x).abs()
    assert (err <= x.abs() * 2**-4 + scale * 2**-10).all()


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_a_quantized_cache_is_attention_on_quantized_keys_and_values(llama, dtype):
    """Prefill 9 tokens, decode 4 over the quantized cache: each step's logits equal an
    uncached forward of the whole sequence whose hook_k / hook_v are fake-quantized."""
    seq = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        logits, cache, slot = fill_cache(
            llama, seq[:, :9], torch.ones(2, 9, dtype=bool), 4, kv_dtype=dtype
        )
        got = [logits]
        for i in range(9, 12):
            got.append(decode_step(llama, seq[:, i : i + 1], torch.tensor([slot]), cache))
            slot += 1

        def quantized(x, hook):
            return torch_fake_quant(x, dtype)

        names = lambda name: name.endswith(("self_attn.hook_k", "self_attn.hook_v"))  # noqa: E731
        with hooks(llama, [(names, quantized)]):
            want = llama(seq[:, :12])  # (2, 12, V)
        plain = llama(seq[:, :12])
    for i, g in enumerate(got):
        torch.testing.assert_close(g, want[:, 8 + i], atol=2e-5, rtol=1e-4)
    assert (got[-1] - plain[:, -1]).abs().max() > 1e-4, "the keys were quantized"


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_a_quantized_pool_gives_the_static_quantized_caches_logits(llama, dtype):
    """Prefill three prompts into a paged pool of blocks of 3, then batched decode steps: the
    logits of the static quantized cache (and not the fp32 cache's)."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 31))]
    pool = PagedKVCache(llama, n_blocks=30, block_size=3, dtype=dtype)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            want, static, slot = fill_cache(
                llama, torch.tensor([p]), torch.ones(1, len(p), dtype=bool), 4, kv_dtype=dtype
            )
            pool.add(b)
            step = pool.step([b], [0], len(p))
            got = llama(torch.tensor([p]), cache=step, slots=step.slots, last_only=True)[:, -1]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            token = want.argmax(-1, keepdim=True)
            _, plain, _ = fill_cache(llama, torch.tensor([p]), torch.ones(1, len(p), dtype=bool), 4)
            for i in range(3):
                want = decode_step(llama, token, torch.tensor([slot + i]), static)
                step = pool.step([b], [len(p) + i], 1)
                got = llama(token, cache=step, slots=step.slots)[:, -1]
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
                fp32 = decode_step(llama, token, torch.tensor([slot + i]), plain)
                assert (got - fp32).abs().max() > 1e-4, "the pool holds quantized keys"
                token = want.argmax(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_the_batched_engine_over_a_quantized_pool_equals_generate(llama, dtype):
    requests = [
        Request(
            f"r{i}",
            tuple(range(3 + i, 3 + i + n)),
            SamplingParams(max_tokens=8 + i, temperature=0.0),
        )
        for i, n in enumerate([5, 17, 1, 30, 9])
    ]
    engine = Engine(
        llama,
        None,
        EngineConfig(block_size=4, prefill_chunk=8, max_context=128, kv_cache_dtype=dtype),
    )
    assert engine.cache.layers[0].k.dtype.itemsize == 1
    tokens = {}
    for r in requests:
        tokens[r.request_id] = []
        engine.submit(
            r,
            lambda e, out=tokens[r.request_id]: e.token_id is not None and out.append(e.token_id),
        )
    while engine.step():
        pass
    for r in requests:
        config = GenerationConfig(r.params.max_tokens, GREEDY, kv_cache_dtype=dtype)
        assert tokens[r.request_id] == generate(llama, [list(r.prompt_ids)], config)[0]


def test_a_quantized_pool_takes_a_quarter_of_the_memory(llama):
    attn = llama.blocks[0].self_attn
    D = attn.head_dim
    plain = PagedKVCache(llama, n_blocks=8, block_size=4)
    for dtype in (INT8, FP8):
        q = PagedKVCache(llama, n_blocks=8, block_size=4, dtype=dtype)
        assert q.nbytes * 4 * D == plain.nbytes * (D + 4)
        assert PagedKVCache.token_bytes(llama, dtype) * 4 * D == PagedKVCache.token_bytes(llama) * (
            D + 4
        )


def test_what_cannot_take_a_quantized_cache_says_so_in_one_line(llama):
    with pytest.raises(ValueError, match="compiled attention reads a float KV pool"):
        Engine(llama, None, EngineConfig(compile_attention=True, kv_cache_dtype=INT8))
    mla = build_model(get_preset("mla-tiny")).eval()
    with pytest.raises(ValueError, match="latent cache is kept in float"):
        fill_cache(mla, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=bool), 2, kv_dtype=INT8)
    with pytest.raises(ValueError, match="choose one of auto, int8, fp8"):
        kv_cache_dtype("int4")
    assert kv_cache_dtype("auto") is None and kv_cache_dtype("fp8") == FP8
