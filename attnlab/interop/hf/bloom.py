"""BLOOM (HF `BloomForCausalLM`) <-> attnlab DecoderLM.

BLOOM is a pre-norm decoder with ALiBi instead of position embeddings. What differs from GPT-2:
- `word_embeddings_layernorm` normalises the token vectors before the first block: our
  `embed_norm` (a decoder's token embedding then carries the norm, `embed.norm`).
- The fused `query_key_value` (3C, C) is laid out per head, rows [q_h, k_h, v_h] for each head h
  in turn (HF `_reshape` views it as (H, 3, D)), not [all q, all k, all v] as GPT-2's c_attn:
  split on load by that view, interleaved again on save.
- Its ALiBi bias is slopes * key position, not -slopes * (query - key) distance: the two differ by
  slopes * query position, the same for every key of a query row, which softmax ignores.
- The MLP is 4C wide with `bloom_gelu`, the tanh approximation (our "gelu_tanh").
Plain nn.Linear modules (weights (out, in)), so nothing is transposed.

Config: huggingface.co/bigscience/bloom-560m/config.json names hidden_size (or n_embed), n_layer,
n_head, layer_norm_epsilon and apply_residual_connection_post_layernorm (False in every released
checkpoint; True adds the residual from the normalised input, which our blocks do not express).
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig

ARCHITECTURES = ("BloomForCausalLM",)
MAX_SEQ_LEN = 2048  # BLOOM's training length; ALiBi itself has no table that bounds it

TABLE: common.KeyTable = [
    ("embed.weight", "transformer.word_embeddings.weight"),
    ("embed.norm.weight", "transformer.word_embeddings_layernorm.weight"),
    ("embed.norm.bias", "transformer.word_embeddings_layernorm.bias"),
    ("blocks.{i}.residuals.0.norm.weight", "transformer.h.{i}.input_layernorm.weight"),
    ("blocks.{i}.residuals.0.norm.bias", "transformer.h.{i}.input_layernorm.bias"),
    # a fused name: the load transforms split it into q_proj, k_proj, v_proj
    ("blocks.{i}.self_attn.qkv.weight", "transformer.h.{i}.self_attention.query_key_value.weight"),
    ("blocks.{i}.self_attn.qkv.bias", "transformer.h.{i}.self_attention.query_key_value.bias"),
    ("blocks.{i}.self_attn.o_proj.weight", "transformer.h.{i}.self_attention.dense.weight"),
    ("blocks.{i}.self_attn.o_proj.bias", "transformer.h.{i}.self_attention.dense.bias"),
    ("blocks.{i}.residuals.1.norm.weight", "transformer.h.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.residuals.1.norm.bias", "transformer.h.{i}.post_attention_layernorm.bias"),
    ("blocks.{i}.ffn.up_proj.weight", "transformer.h.{i}.mlp.dense_h_to_4h.weight"),
    ("blocks.{i}.ffn.up_proj.bias", "transformer.h.{i}.mlp.dense_h_to_4h.bias"),
    ("blocks.{i}.ffn.down_proj.weight", "transformer.h.{i}.mlp.dense_4h_to_h.weight"),
    ("blocks.{i}.ffn.down_proj.bias", "transformer.h.{i}.mlp.dense_4h_to_h.bias"),
    ("norm.weight", "transformer.ln_f.weight"),
    ("norm.bias", "transformer.ln_f.bias"),
]
HEAD: common.KeyTable = [("head.weight", "lm_head.weight")]  # only when untied

FUSED = "blocks.{i}.self_attn.qkv.{p}"
QKV = [
    "blocks.{i}.self_attn.q_proj.{p}",
    "blocks.{i}.self_attn.k_proj.{p}",
    "blocks.{i}.self_attn.v_proj.{p}",
]


def split_per_head(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Fused (3C, ...) rows [q_0, k_0, v_0, q_1, k_1, v_1, ...] -> q, k, v (C, ...) each.

    Viewed as (H, 3, D, ...): index 0, 1, 2 of the second axis are head h's q, k and v rows.
    """
    H, D = cfg.attention.n_heads, cfg.head_dim
    for i in range(cfg.n_layers):
        for p in ("weight", "bias"):
            fused = state.pop(FUSED.format(i=i, p=p))  # (3C, C) or (3C,)
            per_head = fused.view(H, 3, D, *fused.shape[1:])  # (H, 3, D, ...)
            for j, name in enumerate(QKV):
                rows = per_head[:, j].reshape(H * D, *fused.shape[1:])  # (C, ...)
                state[name.format(i=i, p=p)] = rows.clone()  # own memory
    return state


def fuse_per_head(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `split_per_head`: q, k, v (C, ...) -> fused (3C, ...) interleaved per head."""
    H, D = cfg.attention.n_heads, cfg.head_dim
    for i in range(cfg.n_layers):
        for p in ("weight", "bias"):
            parts = [state.pop(name.format(i=i, p=p)) for name in QKV]  # each (C, ...)
            rest = parts[0].shape[1:]
            per_head = torch.stack([t.view(H, D, *rest) for t in parts], dim=1)  # (H, 3, D, ...)
            state[FUSED.format(i=i, p=p)] = per_head.reshape(3 * H * D, *rest)  # (3C, ...)
    return state


def config_from_hf(hf: dict) -> ModelConfig:
    """An HF BLOOM config.json dict -> ModelConfig."""
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ValueError(
            "BLOOM apply_residual_connection_post_layernorm=True (the residual taken after the "
            "norm) is not supported; attnlab's pre-norm blocks add the un-normalised input"
        )
    d_model = hf.get("hidden_size") or common.get(hf, "n_embed", required=True)
    dropout = max(hf.get("hidden_dropout") or 0.0, hf.get("attention_dropout") or 0.0)
    return ModelConfig(
        arch="decoder",
        d_model=d_model,
        n_layers=common.get(hf, "n_layer", required=True),
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=common.get(hf, "seq_length", MAX_SEQ_LEN),
        attention=AttentionConfig(
            n_heads=common.get(hf, "n_head", required=True), qkv_bias=True, out_bias=True
        ),
        position="alibi",
        norm="layernorm",
        norm_eps=common.get(hf, "layer_norm_epsilon", 1e-5),
        ffn="mlp",
        activation="gelu_tanh",  # bloom_gelu: 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))
        d_ff=4 * d_model,
        ffn_bias=True,
        dropout=dropout,
        tie_embeddings=common.get(hf, "tie_word_embeddings", True),
        embed_norm=True,
        init="gpt2",
        init_std=common.get(hf, "initializer_range", 0.02),
    )


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field an HF BLOOM checkpoint cannot represent."""
    common.require(
        cfg,
        "BLOOM",
        {
            "arch": "decoder",
            "position": "alibi",
            "norm": "layernorm",
            "norm_bias": True,
            "norm_placement": "pre",
            "has_final_norm": True,
            "embed_norm": True,
            "ffn": "mlp",
            "activation": "gelu_tanh",
            "ffn_width": 4 * cfg.d_model,
            "ffn_bias": True,
            "attention.kind": "standard",
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "n_kv_heads": cfg.attention.n_heads,
            "head_dim": cfg.d_model // cfg.attention.n_heads,
            "attention.qk_norm": False,
            "attention.softmax_scale": None,
            "attention.sliding_window": None,
            "scale_embeddings": False,
            "head_rescale": False,
            "type_vocab_size": 0,
        },
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF BLOOM config.json dict."""
    check_config(cfg)
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "bloom",
        "hidden_size": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.attention.n_heads,
        "vocab_size": cfg.vocab_size,
        "seq_length": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_dropout": cfg.dropout,
        "attention_dropout": cfg.dropout,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _table(cfg: ModelConfig) -> dict[str, str]:
    return common.expand(TABLE + ([] if cfg.tie_embeddings else HEAD), cfg.n_layers)


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF names and layouts (also run on a meta model for the expected keys)."""
    table = _table(cfg)
    state = fuse_per_head(common.model_state(model), cfg)
    state = common.drop_tied_aliases(model, state, table)
    return common.rename(state, table, what="attnlab BLOOM model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF BLOOM tensors -> our names and layouts."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg).items()}
    return split_per_head(common.rename(state, inverse), cfg)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF BLOOM directory -> (DecoderLM in eval mode, ModelConfig)."""
    if layout != "half":
        raise ValueError(f"BLOOM has no RoPE (it uses ALiBi); layout={layout!r} does not apply")
    hf, state = common.read_config(path), common.read_state_dict(path)
    if not any(k.startswith("transformer.") for k in state):
        # bigscience's checkpoints were saved from BloomModel: no "transformer." prefix, no head
        state = {f"transformer.{k}": v for k, v in state.items()}
    cfg = config_from_hf(hf)
    cfg, state = common.resolve_tie(
        cfg, state, "lm_head.weight", "transformer.word_embeddings.weight"
    )
    model = common.load_checked(
        cfg,
        state,
        to_hf_state,
        from_hf_state,
        [],
        what=f"BLOOM checkpoint {str(path)!r}",
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF BLOOM directory (config.json + model.safetensors)."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
