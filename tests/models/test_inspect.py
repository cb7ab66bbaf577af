"""models/inspect.py: parameter counts, FLOPs per token and KV-cache bytes, checked against
formulas written out here from the config alone."""

import pytest

from attnlab.models.inspect import (
    DTYPE_BYTES,
    ModelStats,
    format_stats,
    inspect_config,
    kv_cache_bytes_per_token,
)
from attnlab.models.presets import get_preset


def gpt2_linear_weights(cfg) -> int:
    """Weights of every matmul in GPT-2: per block q, k, v, o (4 C^2) and the MLP (2 C F), then
    the (tied) LM head C V. Biases are adds, not matmuls, so they cost no multiply-adds."""
    C, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    return L * (4 * C * C + 2 * C * F) + C * V


def test_gpt2_flops_per_token():
    cfg = get_preset("gpt2")
    L, H, D, T = cfg.n_layers, cfg.attention.n_heads, cfg.d_model // cfg.attention.n_heads, 1024
    expected = 2 * gpt2_linear_weights(cfg) + 4 * L * H * D * T
    stats = inspect_config(cfg)
    assert stats.context == cfg.max_seq_len == T
    assert stats.flops_per_token == expected


def test_flops_grow_linearly_with_context():
    cfg = get_preset("gpt2")
    short, long = inspect_config(cfg, context=128), inspect_config(cfg, context=256)
    assert long.flops_per_token - short.flops_per_token == 4 * 12 * 12 * 64 * 128
    assert short.context == 128


@pytest.mark.parametrize(("name", "K"), [("llama3-8b", 8), ("llama2-7b", 32)])
def test_kv_bytes_per_token(name, K):
    cfg = get_preset(name)
    L, D = 32, 128
    assert (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) == (L, K, D)
    for dtype, nbytes in (("bf16", 2), ("fp32", 4)):
        assert kv_cache_bytes_per_token(cfg, dtype) == 2 * L * K * D * nbytes
    assert inspect_config(cfg).kv_bytes_per_token == {
        d: 2 * L * K * D * b for d, b in DTYPE_BYTES.items()
    }


def test_gqa_shrinks_the_cache_by_the_group_size():
    llama2, llama3 = get_preset("llama2-7b"), get_preset("llama3-8b")
    assert kv_cache_bytes_per_token(llama2) == 4 * kv_cache_bytes_per_token(llama3)
    assert kv_cache_bytes_per_token(llama3, "bf16") == 131_072  # 128 KiB per token


def test_encoder_keeps_no_cache():
    assert kv_cache_bytes_per_token(get_preset("bert-base")) == 0


def test_t5_cache_counts_decoder_layers():
    cfg = get_preset("t5-v1_1-small")  # 8 decoder layers, 6 heads of 64
    assert kv_cache_bytes_per_token(cfg, "fp32") == 2 * 8 * 6 * 64 * 4


def test_gpt2_breakdown():
    stats = inspect_config(get_preset("gpt2"))
    assert isinstance(stats, ModelStats)
    assert stats.total_params == 124_439_808
    assert stats.embedding_params == 50257 * 768 + 1024 * 768  # tokens (tied head) + positions
    C, F = 768, 3072
    block = 4 * C * C + 4 * C + 2 * C * F + F + C + 2 * 2 * C  # + biases + two LayerNorms
    assert stats.block_params == [block] * 12
    assert stats.total_params - stats.embedding_params - sum(stats.block_params) == 2 * C


def test_format_stats_mentions_the_counts():
    cfg = get_preset("llama3-8b")
    text = format_stats("llama3-8b", cfg, inspect_config(cfg))
    assert "8,030,261,248" in text
    assert "32 heads / 8 kv" in text
    assert "131,072 B" in text
