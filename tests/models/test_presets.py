"""Presets: published parameter counts (against `transformers` on the meta device), the 2017
paper's Table 3, and a forward pass through every CPU-sized preset.

Every published preset is built on the meta device (shapes only, no memory), so a 7B count costs
well under a second. The `transformers` models are built the same way from hand-written configs
holding the values of each preset's published config.json.
"""

import functools
import math

import pytest
import torch
from torch import nn

from attnlab.models.build import build_model
from attnlab.models.presets import PRESETS, get_preset

CPU_SIZED = 10_000_000  # presets below this many parameters run a real forward pass here


def unique_params(model: nn.Module) -> int:
    """Parameters counted once each, however many modules share them (tied embeddings)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@functools.cache
def ours(name: str) -> int:
    with torch.device("meta"):
        return unique_params(build_model(get_preset(name)))


TINY = sorted(name for name in PRESETS if ours(name) < CPU_SIZED)


# --- transformers reference configs, from each preset's published config.json ----------------
def _gpt2(tf, n_embd: int, n_layer: int, n_head: int):
    cfg = tf.GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head
    )
    return tf.GPT2LMHeadModel, cfg


def _llama_like(model_cls, config_cls, **kw):
    return model_cls, config_cls(tie_word_embeddings=kw.pop("tie_word_embeddings", False), **kw)


def _bert(tf, hidden: int, layers: int, heads: int):
    cfg = tf.BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        type_vocab_size=2,
    )
    return tf.BertForMaskedLM, cfg


def _t5(tf, d_model, layers, heads, d_ff, ffn, tied):
    cfg = tf.T5Config(
        vocab_size=32128,
        d_model=d_model,
        d_kv=64,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=heads,
        feed_forward_proj=ffn,
        tie_word_embeddings=tied,
    )
    return tf.T5ForConditionalGeneration, cfg


def hf_reference(tf, name: str):
    """(model class, config) for a published preset, built from its config.json values."""
    cases = {
        "gpt2": lambda: _gpt2(tf, 768, 12, 12),
        "gpt2-medium": lambda: _gpt2(tf, 1024, 24, 16),
        "gpt2-large": lambda: _gpt2(tf, 1280, 36, 20),
        "gpt2-xl": lambda: _gpt2(tf, 1600, 48, 25),
        "llama2-7b": lambda: _llama_like(
            tf.LlamaForCausalLM,
            tf.LlamaConfig,
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        "llama3-8b": lambda: _llama_like(
            tf.LlamaForCausalLM,
            tf.LlamaConfig,
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
        ),
        "mistral-7b": lambda: _llama_like(
            tf.MistralForCausalLM,
            tf.MistralConfig,
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            sliding_window=4096,
            rms_norm_eps=1e-5,
        ),
        "qwen2-0.5b": lambda: _llama_like(
            tf.Qwen2ForCausalLM,
            tf.Qwen2Config,
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        **_family_references(tf),
        "bert-base": lambda: _bert(tf, 768, 12, 12),
        "bert-large": lambda: _bert(tf, 1024, 24, 16),
        "t5-small": lambda: _t5(tf, 512, 6, 8, 2048, "relu", tied=True),
        "t5-base": lambda: _t5(tf, 768, 12, 12, 3072, "relu", tied=True),
        "t5-v1_1-small": lambda: _t5(tf, 512, 8, 6, 1024, "gated-gelu", tied=False),
    }
    return cases[name]()


def _family_references(tf) -> dict:
    """The newer dense families (models/family_presets.py), from their config.json values."""

    def ref(family: str, model: str = "", **kw):
        return lambda: (
            getattr(tf, f"{model or family}ForCausalLM"),
            getattr(tf, f"{family}Config")(**kw),
        )

    gemma = dict(head_dim=256, query_pre_attn_scalar=256, tie_word_embeddings=True)
    return {
        "qwen3-0.6b": ref(
            "Qwen3",
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "olmo2-7b": ref(
            "Olmo2",
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=100352,
        ),
        "phi3-mini": ref(
            "Phi3",
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
        ),
        "gemma2-2b": ref(
            "Gemma2",
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=256000,
            **gemma,
        ),
        "gemma3-1b": ref(
            "Gemma3Text",
            "Gemma3",
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=262144,
            **gemma,
        ),
    }


def hf_params(name: str) -> int:
    tf = pytest.importorskip("transformers")
    model_cls, cfg = hf_reference(tf, name)
    with torch.device("meta"):
        model = model_cls(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() already dedupes tied ones


HF_PARITY = [
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama2-7b",
    "llama3-8b",
    "mistral-7b",
    "qwen2-0.5b",
    "qwen3-0.6b",
    "olmo2-7b",
    "phi3-mini",
    "gemma2-2b",
    "gemma3-1b",
    "bert-base",
    "bert-large",
    "t5-small",
    "t5-base",
]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.hf
@pytest.mark.parametrize("name", HF_PARITY)
def test_parameter_count_matches_transformers(name):
    assert ours(name) == hf_params(name)


T5_V1_1_SMALL_PUBLISHED = 76_961_152


@pytest.mark.hf
def test_t5_v1_1_small_parameter_count():
    # google/t5-v1_1-small has an untied lm_head (tie_word_embeddings=false in its config.json),
    # and 76,961,152 parameters. transformers 5.x's T5Config reads tie_word_embeddings=False only
    # as "don't rescale the decoder output" and then forces tie_word_embeddings=True, so its meta
    # model shares lm_head with the embedding and comes out exactly one V x C matrix short.
    # We assert the published count, and that the gap to transformers is that one matrix.
    cfg = get_preset("t5-v1_1-small")
    assert ours("t5-v1_1-small") == T5_V1_1_SMALL_PUBLISHED
    hf = hf_params("t5-v1_1-small")
    assert hf in (T5_V1_1_SMALL_PUBLISHED, T5_V1_1_SMALL_PUBLISHED - cfg.vocab_size * cfg.d_model)


def vaswani_count(n_layers: int, d_model: int, d_ff: int, vocab: int) -> int:
    """The 2017 model's parameters, read off the paper (Vaswani et al. 2017).

    §3.2.2: W_Q, W_K, W_V (h heads of d_k = d_model / h) and W_O, each d_model x d_model; §3.3:
    two linear layers d_model -> d_ff -> d_model; §3.1: LayerNorm after every sub-layer; §3.4 and
    §5.1: one shared ~37,000-token vocabulary whose matrix serves both embeddings and the
    pre-softmax projection (counted once). Every projection has a bias, every LayerNorm a gain
    and a bias; sinusoidal positions (§3.5) have no parameters.
    """
    attention = 4 * (d_model * d_model + d_model)
    ffn = (d_model * d_ff + d_ff) + (d_ff * d_model + d_model)
    norm = 2 * d_model
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm  # self-attention and encoder-decoder attention
    return n_layers * (encoder_layer + decoder_layer) + vocab * d_model


@pytest.mark.parametrize(
    ("name", "d_model", "d_ff", "expected"),
    [("transformer-base", 512, 2048, 63_082_496), ("transformer-big", 1024, 4096, 214_245_376)],
)
def test_vaswani_presets_are_the_papers_architecture(name, d_model, d_ff, expected):
    assert vaswani_count(6, d_model, d_ff, 37_000) == expected
    assert ours(name) == expected


# The paper's "65M" is not reachable from its own description: the non-embedding part is
# 44.14M, so 65M needs a ~40.7k vocabulary while "big" (176.36M + V x 1024 = 213M) needs ~35.8k;
# no single vocabulary gives both, and §5.1's ~37k (3-way tied) gives 63.08M, 2.95% short. Within
# 2% of 65M needs V >= 38.2k, which is not "about 37000"; so the preset stays as the paper
# describes it, and this gap is recorded rather than hidden by a wider tolerance.
BASE_GAP = "Table 3's 65M is 2.95% above the described model (63.08M, see vaswani_count)"


@pytest.mark.parametrize(
    ("name", "paper"),
    [
        pytest.param(
            "transformer-base", 65_000_000, marks=pytest.mark.xfail(strict=True, reason=BASE_GAP)
        ),
        ("transformer-big", 213_000_000),
    ],
)
def test_vaswani_table3_parameter_counts_within_2_percent(name, paper):
    """Vaswani et al. 2017, Table 3 reports 65M (base) and 213M (big); the spec allows 2%."""
    assert math.isclose(ours(name), paper, rel_tol=0.02)


def test_published_counts_without_transformers():
    """The headline numbers, so a missing `transformers` still checks something."""
    assert ours("gpt2") == 124_439_808
    assert ours("llama2-7b") == 6_738_415_616
    assert ours("bert-base") == 109_514_298
    assert ours("t5-small") == 60_506_624


def test_tied_presets_share_one_matrix():
    with torch.device("meta"):
        gpt2 = build_model(get_preset("gpt2"))
        llama = build_model(get_preset("llama2-7b"))
    assert gpt2.head.weight is gpt2.embed.weight
    assert llama.head.weight is not llama.embed.weight


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_forward(name):
    cfg = get_preset(name)
    model = build_model(cfg).eval()
    B, T = 2, 5
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        if cfg.arch == "encoder_decoder":
            src = torch.randint(0, cfg.vocab_size, (B, T + 2))
            logits = model(src, ids)
        else:
            logits = model(ids)
    assert logits.shape == (B, T, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_every_tiny_family_present():
    assert {"gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny", "transformer-tiny"} <= set(TINY)
    archs = {get_preset(name).arch for name in TINY}
    assert archs == {"decoder", "encoder", "encoder_decoder"}


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match=r"'gpt5'.*gpt2"):
        get_preset("gpt5")
