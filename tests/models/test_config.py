"""ModelConfig validation, dict/JSON round trips and dotted overrides (attnlab.configs)."""

import dataclasses
import json

import pytest

from attnlab.configs import from_dict, override, to_dict
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.models.presets import PRESETS, get_preset


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder", d_model=32, n_layers=1, vocab_size=64, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


# --- validation: every error names the offending values ----------------------------------------
def test_d_model_not_divisible_by_n_heads():
    with pytest.raises(ValueError, match=r"d_model=30.*n_heads=4"):
        tiny(d_model=30, attention=AttentionConfig(n_heads=4))


def test_explicit_head_dim_lifts_divisibility():
    cfg = tiny(d_model=30, attention=AttentionConfig(n_heads=4, head_dim=8))
    assert cfg.head_dim == 8


def test_n_heads_not_divisible_by_n_kv_heads():
    with pytest.raises(ValueError, match=r"n_heads=6.*n_kv_heads=4"):
        AttentionConfig(n_heads=6, n_kv_heads=4)


def test_odd_head_dim_with_rope():
    with pytest.raises(ValueError, match=r"head_dim=15"):
        tiny(d_model=60, attention=AttentionConfig(n_heads=4), position="rope")
    # Without RoPE an odd head_dim is fine.
    assert tiny(d_model=60, attention=AttentionConfig(n_heads=4), position="alibi").head_dim == 15


def test_odd_rotary_part_with_partial_rope():
    # head_dim 16, int(16 * 0.3125) = 5 rotated features: not whole pairs.
    with pytest.raises(ValueError, match=r"head_dim=16 \(rotary part 5\)"):
        tiny(attention=AttentionConfig(n_heads=2), rope=RopeConfig(partial_rotary=0.3125))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("position", "relative"),
        ("norm", "batchnorm"),
        ("ffn", "moe"),
        ("activation", "tanh"),
        ("arch", "decoder_only"),
        ("norm_placement", "middle"),
        ("init", "kaiming"),
    ],
)
def test_unknown_variant_names(field, value):
    with pytest.raises(ValueError, match=rf"{field}='{value}'.*is not one of"):
        tiny(**{field: value})


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend='fused'"):
        AttentionConfig(backend="fused")


def test_unknown_rope_layout():
    with pytest.raises(ValueError, match=r"layout='neox'"):
        RopeConfig(layout="neox")


def test_geglu_needs_a_gelu():
    with pytest.raises(ValueError, match=r"geglu.*activation='relu'"):
        tiny(ffn="geglu", activation="relu")
    assert tiny(ffn="geglu", activation="gelu_tanh").ffn == "geglu"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(d_model=0), r"d_model must be >= 1, got 0"),
        (dict(n_layers=-1), r"n_layers must be >= 1, got -1"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_out_of_range_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_bad_sliding_window():
    with pytest.raises(ValueError, match=r"sliding_window must be >= 1, got 0"):
        AttentionConfig(sliding_window=0)


def test_resolved_fields():
    cfg = tiny(d_model=64, attention=AttentionConfig(n_heads=8, n_kv_heads=2), ffn="mlp")
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.ffn_width) == (8, 2, 256)
    assert tiny(d_model=96, ffn="swiglu").ffn_width == 256  # 8/3 * 96 = 256, a multiple of 64
    assert tiny(norm_placement="post").has_final_norm is False
    assert tiny(norm_placement="pre").has_final_norm is True


# --- plain data round trips --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_json_round_trip(name):
    cfg = get_preset(name)
    data = json.loads(json.dumps(to_dict(cfg)))
    assert from_dict(ModelConfig, data) == cfg


def test_from_dict_unknown_key():
    data = to_dict(get_preset("gpt2-tiny"))
    data["n_layer"] = 4
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['n_layer'\]"):
        from_dict(ModelConfig, data)


def test_from_dict_unknown_nested_key():
    data = to_dict(get_preset("gpt2-tiny"))
    data["attention"]["num_heads"] = 4
    with pytest.raises(ValueError, match=r"unknown AttentionConfig fields \['num_heads'\]"):
        from_dict(ModelConfig, data)


def test_from_dict_missing_required_fields():
    with pytest.raises(ValueError, match=r"needs fields \['arch', 'n_layers'"):
        from_dict(ModelConfig, {"d_model": 32, "vocab_size": 10, "max_seq_len": 8})


def test_from_dict_partial_uses_defaults():
    cfg = from_dict(
        ModelConfig,
        {
            "arch": "encoder",
            "d_model": 32,
            "n_layers": 1,
            "vocab_size": 10,
            "max_seq_len": 8,
            "attention": {"n_heads": 2},
        },
    )
    assert cfg.attention == AttentionConfig(n_heads=2)
    assert cfg.rope == RopeConfig()


def test_from_dict_validates():
    data = to_dict(get_preset("gpt2-tiny"))
    data["norm"] = "batchnorm"
    with pytest.raises(ValueError, match="batchnorm"):
        from_dict(ModelConfig, data)


# --- dotted overrides --------------------------------------------------------------------------
def test_override_nested_and_top_level():
    cfg = get_preset("llama-tiny")
    out = override(cfg, "attention.n_heads", "8")
    assert out.attention.n_heads == 8 and out.attention.n_kv_heads == cfg.attention.n_kv_heads
    assert override(cfg, "rope.theta", "500000").rope.theta == 500000.0
    assert override(cfg, "n_layers", "4").n_layers == 4
    assert override(cfg, "attention.n_kv_heads", "none").attention.n_kv_heads is None
    assert override(cfg, "attention.backend", "eager").attention.backend == "eager"
    assert override(cfg, "tie_embeddings", "true").tie_embeddings is True
    # The original is untouched (frozen dataclasses, replaced not mutated).
    assert cfg == get_preset("llama-tiny")


@pytest.mark.parametrize(
    ("path", "text", "match"),
    [
        ("n_layer", "4", r"no field 'n_layer'"),
        ("attention.heads", "4", r"AttentionConfig has no field 'heads'"),
        ("rope.scaling.factor", "2", r"'rope.scaling.factor': section 'rope.scaling' is None"),
        ("n_layers", "four", r"'four'"),
        ("attention.backend", "fused", r"'fused'"),
        ("attention.n_heads", "3", r"n_heads=3.*n_kv_heads=2"),
        ("attention.n_heads", "6", r"d_model=64.*n_heads=6"),
    ],
)
def test_override_bad_paths_and_values(path, text, match):
    with pytest.raises(ValueError, match=match):
        override(get_preset("llama-tiny"), path, text)


def test_override_into_a_leaf_is_an_error():
    with pytest.raises(ValueError, match=r"'n_layers' is not a section, cannot set 'n_layers.x'"):
        override(get_preset("llama-tiny"), "n_layers.x", "1")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_preset("gpt2-tiny").n_layers = 3
