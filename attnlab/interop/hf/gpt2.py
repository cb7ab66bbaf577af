"""GPT-2 (HF `GPT2LMHeadModel`, `GPT2ForSequenceClassification`) <-> attnlab DecoderLM and
DecoderForSequenceClassification (whose `head` is HF's `score`; labels in ModelConfig.head).

Two things differ from our layout:
- GPT-2 uses `Conv1D` modules, which store weights as (in, out): every projection is transposed.
- Attention's q, k and v come from one fused `c_attn` (C, 3C): split on load, fused on save.

Config: huggingface.co/openai-community/gpt2/config.json names n_embd, n_layer, n_head, n_inner,
n_positions, activation_function ("gelu_new" is the tanh approximation) and layer_norm_epsilon.
"""

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2ForSequenceClassification")

TABLE: common.KeyTable = [
    ("embed.weight", "transformer.wte.weight"),
    ("positions.table.weight", "transformer.wpe.weight"),
    ("blocks.{i}.residuals.0.norm.weight", "transformer.h.{i}.ln_1.weight"),
    ("blocks.{i}.residuals.0.norm.bias", "transformer.h.{i}.ln_1.bias"),
    # a fused name: the load transforms split it into q_proj, k_proj, v_proj
    ("blocks.{i}.self_attn.qkv.weight", "transformer.h.{i}.attn.c_attn.weight"),
    ("blocks.{i}.self_attn.qkv.bias", "transformer.h.{i}.attn.c_attn.bias"),
    ("blocks.{i}.self_attn.o_proj.weight", "transformer.h.{i}.attn.c_proj.weight"),
    ("blocks.{i}.self_attn.o_proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
    ("blocks.{i}.residuals.1.norm.weight", "transformer.h.{i}.ln_2.weight"),
    ("blocks.{i}.residuals.1.norm.bias", "transformer.h.{i}.ln_2.bias"),
    ("blocks.{i}.ffn.up_proj.weight", "transformer.h.{i}.mlp.c_fc.weight"),
    ("blocks.{i}.ffn.up_proj.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    ("blocks.{i}.ffn.down_proj.weight", "transformer.h.{i}.mlp.c_proj.weight"),
    ("blocks.{i}.ffn.down_proj.bias", "transformer.h.{i}.mlp.c_proj.bias"),
    ("norm.weight", "transformer.ln_f.weight"),
    ("norm.bias", "transformer.ln_f.bias"),
]
HEAD: common.KeyTable = [("head.weight", "lm_head.weight")]  # only when untied
SCORE: common.KeyTable = [("head.weight", "score.weight")]  # a sequence classifier's head
# Buffers older checkpoints wrote (the causal mask), which HF itself skips.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")

CONV1D = [
    "blocks.{i}.self_attn.qkv.weight",
    "blocks.{i}.self_attn.o_proj.weight",
    "blocks.{i}.ffn.up_proj.weight",
    "blocks.{i}.ffn.down_proj.weight",
]
QKV = [
    "blocks.{i}.self_attn.q_proj.{p}",
    "blocks.{i}.self_attn.k_proj.{p}",
    "blocks.{i}.self_attn.v_proj.{p}",
]


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    return [cfg.d_model] * 3


def _parts(param: str) -> list[str]:
    return [p.replace("{p}", param) for p in QKV]


LOAD_TRANSFORMS: list[common.Transform] = [
    common.transpose(CONV1D),  # (in, out) -> (out, in)
    common.split_rows("blocks.{i}.self_attn.qkv.weight", _parts("weight"), _qkv_sizes),
    common.split_rows("blocks.{i}.self_attn.qkv.bias", _parts("bias"), _qkv_sizes),
]
SAVE_TRANSFORMS: list[common.Transform] = [
    common.fuse_rows(_parts("weight"), "blocks.{i}.self_attn.qkv.weight"),
    common.fuse_rows(_parts("bias"), "blocks.{i}.self_attn.qkv.bias"),
    common.transpose(CONV1D),  # (out, in) -> (in, out)
]


def config_from_hf(hf: dict) -> ModelConfig:
    """An HF GPT-2 config.json dict -> ModelConfig."""
    unsupported = {
        k: hf[k] for k in ("scale_attn_by_inverse_layer_idx", "add_cross_attention") if hf.get(k)
    }
    if unsupported:
        raise ValueError(f"GPT-2 options attnlab does not implement: {unsupported}")
    d_model = common.get(hf, "n_embd", required=True)
    return ModelConfig(
        arch="decoder",
        d_model=d_model,
        n_layers=common.get(hf, "n_layer", required=True),
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=common.get(hf, "n_positions", required=True),
        attention=AttentionConfig(
            n_heads=common.get(hf, "n_head", required=True),
            qkv_bias=True,
            out_bias=True,
            softmax_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        ),
        position="learned",
        norm="layernorm",
        norm_eps=common.get(hf, "layer_norm_epsilon", 1e-5),
        ffn="mlp",
        activation=common.activation_from_hf(
            common.get(hf, "activation_function", "gelu_new"), "activation_function"
        ),
        d_ff=common.get(hf, "n_inner", 4 * d_model),
        ffn_bias=True,
        dropout=common.get(hf, "resid_pdrop", 0.0),
        tie_embeddings=common.get(hf, "tie_word_embeddings", True),
        init="gpt2",
        init_std=common.get(hf, "initializer_range", 0.02),
    )


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field an HF GPT-2 checkpoint cannot represent."""
    common.require(
        cfg,
        "GPT-2",
        {
            "arch": "decoder",
            "position": "learned",
            "norm": "layernorm",
            "norm_bias": True,
            "norm_placement": "pre",
            "has_final_norm": True,
            "ffn": "mlp",
            "ffn_bias": True,
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "n_kv_heads": cfg.attention.n_heads,
            "head_dim": cfg.d_model // cfg.attention.n_heads,
            "attention.qk_norm": False,
            "attention.softmax_scale": (None, 1.0),
            "attention.sliding_window": None,
            "scale_embeddings": False,
            "head_rescale": False,
            "embed_norm": False,
            "type_vocab_size": 0,
        },
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF GPT-2 config.json dict."""
    check_config(cfg)
    hf = {
        "architectures": [
            "GPT2LMHeadModel" if cfg.head is None else "GPT2ForSequenceClassification"
        ],
        "model_type": "gpt2",
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.attention.n_heads,
        "n_inner": cfg.ffn_width,
        "n_positions": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "activation_function": common.activation_to_hf(cfg.activation),
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": cfg.attention.softmax_scale is None,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": cfg.init_std,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if cfg.head is not None:
        hf.update(common.head_to_hf(cfg.head), pad_token_id=cfg.head.pad_token_id)
    return hf


def _table(cfg: ModelConfig) -> dict[str, str]:
    head = SCORE if cfg.head is not None else [] if cfg.tie_embeddings else HEAD
    return common.expand(TABLE + head, cfg.n_layers)


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF names and layouts (also run on a meta model for the expected keys)."""
    table = _table(cfg)
    state = common.apply(SAVE_TRANSFORMS, common.model_state(model), cfg)
    state = common.drop_tied_aliases(model, state, table)
    return common.rename(state, table, what="attnlab GPT-2 model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF GPT-2 tensors -> our names and layouts."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg).items()}
    return common.apply(LOAD_TRANSFORMS, common.rename(state, inverse), cfg)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF GPT-2 directory -> (DecoderLM or DecoderForSequenceClassification, eval mode; cfg)."""
    if layout != "half":
        raise ValueError(f"GPT-2 has no RoPE; layout={layout!r} does not apply")
    hf, state = common.read_config(path), common.read_state_dict(path)
    cfg = config_from_hf(hf)
    if "GPT2ForSequenceClassification" in (hf.get("architectures") or []):
        cfg = replace(cfg, head=common.head_from_hf(hf, "sequence", hf.get("pad_token_id")))
    else:
        cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "transformer.wte.weight")
    ignore = [k for k in state if k.endswith(IGNORED_SUFFIXES)]
    model = common.load_checked(
        cfg,
        state,
        to_hf_state,
        from_hf_state,
        ignore,
        what=f"GPT-2 checkpoint {str(path)!r}",
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF GPT-2 directory (config.json + model.safetensors)."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
