"""Presets of the newer dense families: Qwen3, OLMo 2, Phi-3, Gemma 2, Gemma 3 (text).

Each is a Llama-shaped decoder (RoPE, RMSNorm, gated FFN, GQA) with a few newer components,
all config fields the builder reads: QK-norm (`attention.qk_norm`, per head or over the whole
projection), norms on the sublayer outputs (`norm_placement` "sandwich" / "post_sublayer"),
Gemma's (1 + w) RMSNorm (`norm_unit_offset`), logit soft-caps (`attention.logit_softcap`,
`logit_softcap`), sliding-window layers alternating with global ones (`attention.global_every`)
and a RoPE base of their own for the local layers (`rope.local_theta`). Every number comes from
the published config.json named in each docstring; tests/models/test_presets.py counts the
parameters against transformers. `PRESETS` (models/presets.py) includes all of them.
"""

from collections.abc import Callable
from dataclasses import replace

from attnlab.components.positions.rope import RopeScaling
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig


def _decoder(
    d_model,
    n_layers,
    n_heads,
    n_kv_heads,
    head_dim,
    d_ff,
    vocab,
    max_len,
    theta,
    eps,
    attention: dict | None = None,
    **extra,
) -> ModelConfig:
    """A Llama-shaped decoder; `attention` and `extra` set the family's own fields."""
    return ModelConfig(
        arch="decoder",
        d_model=d_model,
        n_layers=n_layers,
        vocab_size=vocab,
        max_seq_len=max_len,
        attention=AttentionConfig(n_heads, n_kv_heads, head_dim, **(attention or {})),
        position="rope",
        rope=extra.pop("rope", RopeConfig(theta=theta)),
        norm="rmsnorm",
        norm_eps=eps,
        ffn=extra.pop("ffn", "swiglu"),
        d_ff=d_ff,
        tie_embeddings=extra.pop("tie_embeddings", False),
        **extra,
    )


def qwen3_0_6b() -> ModelConfig:
    """Qwen3-0.6B (QK-norm per head, head_dim 128 > d_model / n_heads, tied):
    huggingface.co/Qwen/Qwen3-0.6B/config.json; Qwen3 Technical Report, arXiv:2505.09388."""
    return _decoder(
        1024, 28, 16, 8, 128, 3072, 151936, 40960, 1e6, 1e-6, {"qk_norm": True}, tie_embeddings=True
    )


def olmo2_7b() -> ModelConfig:
    """OLMo-2-1124-7B (QK-norm over the projections, norms on the sublayer outputs only):
    huggingface.co/allenai/OLMo-2-1124-7B/config.json; OLMo 2, arXiv:2501.00656 §3.2."""
    return _decoder(
        4096,
        32,
        32,
        32,
        None,
        11008,
        100352,
        4096,
        500000.0,
        1e-6,
        {"qk_norm": True, "qk_norm_scope": "projection"},
        norm_placement="post_sublayer",
    )


def phi3_mini() -> ModelConfig:
    """Phi-3-mini-4k-instruct (a Llama with fused qkv / gate_up in HF, window 2047):
    huggingface.co/microsoft/Phi-3-mini-4k-instruct/config.json; arXiv:2404.14219."""
    return _decoder(
        3072, 32, 32, 32, None, 8192, 32064, 4096, 10000.0, 1e-5, {"sliding_window": 2047}
    )


def _gemma(
    d_model,
    n_layers,
    n_heads,
    n_kv_heads,
    d_ff,
    vocab,
    max_len,
    window,
    every,
    attention: dict | None = None,
    **extra,
) -> ModelConfig:
    """Sandwich norms with (1 + w), embeddings * sqrt(d_model), GeGLU with tanh GELU, head_dim
    256 and query_pre_attn_scalar 256 (so the usual 256^-0.5 scale), tied embeddings."""
    attention = {"sliding_window": window, "global_every": every, **(attention or {})}
    return _decoder(
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        256,
        d_ff,
        vocab,
        max_len,
        extra.pop("theta", 10000.0),
        1e-6,
        attention,
        ffn="geglu",
        activation="gelu_tanh",
        norm_placement="sandwich",
        norm_unit_offset=True,
        scale_embeddings=True,
        tie_embeddings=True,
        **extra,
    )


GEMMA2_SOFTCAP = {"logit_softcap": 50.0, "backend": "eager"}  # soft-capping is written out


def gemma2_2b() -> ModelConfig:
    """Gemma-2-2B (local window 4096 on every other layer; attention logits capped at 50,
    final logits at 30): huggingface.co/google/gemma-2-2b/config.json; arXiv:2408.00118."""
    return _gemma(2304, 26, 8, 4, 9216, 256000, 8192, 4096, 2, GEMMA2_SOFTCAP, logit_softcap=30.0)


def gemma3_1b() -> ModelConfig:
    """Gemma-3-1B (text; QK-norm, 5 local layers of window 512 per global one, local RoPE base
    10k, global 1M): huggingface.co/google/gemma-3-1b-pt/config.json; arXiv:2503.19786."""
    rope = RopeConfig(theta=1e6, local_theta=10000.0)
    return _gemma(1152, 26, 4, 1, 6912, 262144, 32768, 512, 6, {"qk_norm": True}, rope=rope)


def _tiny(cfg: ModelConfig, **attention) -> ModelConfig:
    """A CPU-sized member of a family: 2 layers, d_model 64, 4 heads of 16, 2 kv heads."""
    a = replace(cfg.attention, n_heads=4, n_kv_heads=2, head_dim=16, **attention)
    return replace(
        cfg, d_model=64, n_layers=2, vocab_size=256, max_seq_len=128, d_ff=128, attention=a
    )


def qwen3_tiny() -> ModelConfig:
    return _tiny(qwen3_0_6b())


def olmo2_tiny() -> ModelConfig:
    return _tiny(olmo2_7b())


def gemma2_tiny() -> ModelConfig:
    """Window 8 on layer 0, global layer 1."""
    return _tiny(gemma2_2b(), sliding_window=8)


def gemma3_tiny() -> ModelConfig:
    """Window 8 on layer 0, global layer 1 (linear RoPE scaling there, as Gemma 3 4B+)."""
    cfg = _tiny(gemma3_1b(), sliding_window=8, global_every=2)
    return replace(cfg, rope=replace(cfg.rope, scaling=RopeScaling("linear", 8.0, 128)))


FAMILY_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "qwen3-0.6b": qwen3_0_6b,
    "olmo2-7b": olmo2_7b,
    "phi3-mini": phi3_mini,
    "gemma2-2b": gemma2_2b,
    "gemma3-1b": gemma3_1b,
    "qwen3-tiny": qwen3_tiny,
    "olmo2-tiny": olmo2_tiny,
    "gemma2-tiny": gemma2_tiny,
    "gemma3-tiny": gemma3_tiny,
}
