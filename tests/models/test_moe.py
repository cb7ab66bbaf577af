"""MoE in whole models: the builder's layers, parameter counts (total against transformers,
active against Mixtral's published 12.9B), FLOPs per token, and config errors."""

from dataclasses import replace

import pytest
import torch

from attnlab.components.ffn import GatedMLP
from attnlab.components.moe import MoE
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig, MoEConfig
from attnlab.models.inspect import flops_split, format_stats, inspect_config
from attnlab.models.presets import get_preset


def test_first_dense_layers_keep_a_dense_ffn():
    cfg = get_preset("moe-tiny")
    model = build_model(replace(cfg, moe=replace(cfg.moe, first_dense_layers=1)))
    assert isinstance(model.blocks[0].ffn, GatedMLP) and isinstance(model.blocks[1].ffn, MoE)


@pytest.mark.slow  # transformers' Mixtral built on the meta device
@pytest.mark.hf
def test_mixtral_8x7b_counts_match_transformers_and_the_paper():
    tf = pytest.importorskip("transformers")
    hf_cfg = tf.MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        hf = tf.MixtralForCausalLM(hf_cfg)
    s = inspect_config(get_preset("mixtral-8x7b"), context=1)
    assert s.total_params == sum(p.numel() for p in hf.parameters())  # 46.7B
    assert round(s.active_params / 1e9, 1) == 12.9  # arXiv:2401.04088 §2: "13B active"


def test_flops_count_the_k_experts_a_token_uses():
    cfg = get_preset("moe-tiny")
    s = inspect_config(cfg, context=16)
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    attention = cfg.n_layers * 4 * cfg.attention.n_heads * cfg.head_dim * 16
    weights = s.active_params - s.embedding_params - norms  # the untied head counts
    assert s.flops_per_token == 2 * weights + attention
    assert "2 of 4 experts" in format_stats("moe-tiny", cfg, s)


def test_moe_needs_a_decoder_with_swiglu():
    with pytest.raises(ValueError, match="ffn='mlp'"):
        ModelConfig("decoder", 32, 2, 64, 16, ffn="mlp", moe=MoEConfig(4, 2))


def test_the_flops_split_counts_the_router_and_k_experts_as_ffn():
    cfg = get_preset("moe-tiny")
    m, C = cfg.moe, cfg.d_model
    split = flops_split(cfg, context=16)
    per_layer = 2 * C * m.n_experts + m.n_experts_per_token * 2 * 3 * C * cfg.expert_width
    assert split["ffn"] == cfg.n_layers * per_layer
    assert sum(split.values()) == inspect_config(cfg, context=16).flops_per_token
