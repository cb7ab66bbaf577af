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


def _decoder(attention: AttentionConfig, theta: float, **fields) -> ModelConfig:
    """A Llama-shaped decoder (RoPE, RMSNorm, SwiGLU unless `fields` say otherwise, untied)."""
    fields = {"ffn": "swiglu", "tie_embeddings": False, "rope": RopeConfig(theta=theta)} | fields
    return ModelConfig(
        arch="decoder", attention=attention, position="rope", norm="rmsnorm", **fields
    )


def qwen3_0_6b() -> ModelConfig:
    """Qwen3-0.6B (QK-norm per head, head_dim 128 > d_model / n_heads, tied):
    huggingface.co/Qwen/Qwen3-0.6B/config.json; Qwen3 Technical Report, arXiv:2505.09388."""
    attention = AttentionConfig(n_heads=16, n_kv_heads=8, head_dim=128, qk_norm=True)
    return _decoder(attention, 1e6, d_model=1024, n_layers=28, d_ff=3072, vocab_size=151936,
                    max_seq_len=40960, norm_eps=1e-6, tie_embeddings=True)  # fmt: skip


def olmo2_7b() -> ModelConfig:
    """OLMo-2-1124-7B (QK-norm over the projections, norms on the sublayer outputs only):
    huggingface.co/allenai/OLMo-2-1124-7B/config.json; OLMo 2, arXiv:2501.00656 §3.2."""
    attention = AttentionConfig(n_heads=32, n_kv_heads=32, qk_norm=True, qk_norm_scope="projection")
    return _decoder(attention, 500000.0, d_model=4096, n_layers=32, d_ff=11008,
                    vocab_size=100352, max_seq_len=4096, norm_eps=1e-6,
                    norm_placement="post_sublayer")  # fmt: skip


def phi3_mini() -> ModelConfig:
    """Phi-3-mini-4k-instruct (a Llama with fused qkv / gate_up in HF, window 2047):
    huggingface.co/microsoft/Phi-3-mini-4k-instruct/config.json; arXiv:2404.14219."""
    attention = AttentionConfig(n_heads=32, n_kv_heads=32, sliding_window=2047)
    return _decoder(attention, 10000.0, d_model=3072, n_layers=32, d_ff=8192, vocab_size=32064,
                    max_seq_len=4096, norm_eps=1e-5)  # fmt: skip


def _gemma(attention: AttentionConfig, rope: RopeConfig, **fields) -> ModelConfig:
    """Sandwich norms with (1 + w), embeddings * sqrt(d_model), GeGLU with tanh GELU, head_dim
    256 and query_pre_attn_scalar 256 (so the usual 256^-0.5 scale), tied embeddings."""
    return _decoder(attention, rope.theta, rope=rope, ffn="geglu", activation="gelu_tanh",
                    norm_placement="sandwich", norm_unit_offset=True, norm_eps=1e-6,
                    scale_embeddings=True, tie_embeddings=True, **fields)  # fmt: skip


def gemma2_2b() -> ModelConfig:
    """Gemma-2-2B (local window 4096 on every other layer; attention logits capped at 50,
    final logits at 30): huggingface.co/google/gemma-2-2b/config.json; arXiv:2408.00118."""
    attention = AttentionConfig(
        n_heads=8,
        n_kv_heads=4,
        head_dim=256,
        sliding_window=4096,
        global_every=2,
        logit_softcap=50.0,
        backend="eager",  # soft-capped attention is written out
    )
    return _gemma(attention, RopeConfig(theta=10000.0), d_model=2304, n_layers=26, d_ff=9216,
                  vocab_size=256000, max_seq_len=8192, logit_softcap=30.0)  # fmt: skip


def gemma3_1b() -> ModelConfig:
    """Gemma-3-1B (text; QK-norm, 5 local layers of window 512 per global one, local RoPE base
    10k, global 1M): huggingface.co/google/gemma-3-1b-pt/config.json; arXiv:2503.19786."""
    attention = AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=256, sliding_window=512,
                                global_every=6, qk_norm=True)  # fmt: skip
    rope = RopeConfig(theta=1e6, local_theta=10000.0)
    return _gemma(attention, rope, d_model=1152, n_layers=26, d_ff=6912, vocab_size=262144,
                  max_seq_len=32768)  # fmt: skip


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
