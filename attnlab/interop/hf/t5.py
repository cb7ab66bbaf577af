"""T5 (HF `T5ForConditionalGeneration`) <-> attnlab EncoderDecoder.

- v1.0 (t5-small): ReLU MLP, LM head tied to the shared embedding, and the decoder output scaled
  by d_model^-0.5 before the tied head (our `head_rescale`).
- v1.1 (google/t5-v1_1-*): gated-GELU (tanh) FFN, `wi_0` the gate and `wi_1` the linear half
  (our gate_proj / up_proj), untied head, no rescale.
- The relative position bias lives in layer 0 of each HF stack and is reused by every layer;
  ours is one T5Bias module per stack (`encoder.positions`, `decoder.positions`).

transformers 5 always ties T5's lm_head in the config (`tie_word_embeddings` is forced to True
and the old flag survives as `scale_decoder_outputs`); a checkpoint whose stored lm_head.weight
differs from shared.weight is loaded untied, by HF and here alike.

Config: huggingface.co/google-t5/t5-small/config.json, huggingface.co/google/t5-v1_1-small.
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig

ARCHITECTURES = ("T5ForConditionalGeneration",)

SHARED: common.KeyTable = [
    ("encoder.embed.weight", "shared.weight"),  # the decoder's embedding is the same module
]
# Rows of one stack, relative to it: "encoder." or "decoder." goes in front on both sides.
STACK: common.KeyTable = [
    (
        "positions.relative_attention_bias.weight",  # ours: one T5Bias per stack; HF: in layer 0
        "block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    ),
    ("blocks.{i}.residuals.0.norm.weight", "block.{i}.layer.0.layer_norm.weight"),
    ("blocks.{i}.self_attn.q_proj.weight", "block.{i}.layer.0.SelfAttention.q.weight"),
    ("blocks.{i}.self_attn.k_proj.weight", "block.{i}.layer.0.SelfAttention.k.weight"),
    ("blocks.{i}.self_attn.v_proj.weight", "block.{i}.layer.0.SelfAttention.v.weight"),
    ("blocks.{i}.self_attn.o_proj.weight", "block.{i}.layer.0.SelfAttention.o.weight"),
    ("norm.weight", "final_layer_norm.weight"),
]
CROSS_ATTENTION: common.KeyTable = [  # decoder only, HF's layer 1
    ("blocks.{i}.residuals.1.norm.weight", "block.{i}.layer.1.layer_norm.weight"),
    ("blocks.{i}.cross_attn.q_proj.weight", "block.{i}.layer.1.EncDecAttention.q.weight"),
    ("blocks.{i}.cross_attn.k_proj.weight", "block.{i}.layer.1.EncDecAttention.k.weight"),
    ("blocks.{i}.cross_attn.v_proj.weight", "block.{i}.layer.1.EncDecAttention.v.weight"),
    ("blocks.{i}.cross_attn.o_proj.weight", "block.{i}.layer.1.EncDecAttention.o.weight"),
]
# The FFN is HF's layer {n}: 1 in the encoder, 2 in the decoder (after cross-attention).
FFN: common.KeyTable = [
    ("blocks.{i}.residuals.{n}.norm.weight", "block.{i}.layer.{n}.layer_norm.weight"),
    ("blocks.{i}.ffn.down_proj.weight", "block.{i}.layer.{n}.DenseReluDense.wo.weight"),
]
FFN_MLP: common.KeyTable = [  # v1.0: ReLU
    ("blocks.{i}.ffn.up_proj.weight", "block.{i}.layer.{n}.DenseReluDense.wi.weight"),
]
FFN_GATED: common.KeyTable = [  # v1.1: act(wi_0 x) * wi_1 x
    ("blocks.{i}.ffn.gate_proj.weight", "block.{i}.layer.{n}.DenseReluDense.wi_0.weight"),
    ("blocks.{i}.ffn.up_proj.weight", "block.{i}.layer.{n}.DenseReluDense.wi_1.weight"),
]
HEAD: common.KeyTable = [("decoder.head.weight", "lm_head.weight")]  # only when untied
# HF ties these to shared.weight (older checkpoints stored them), and skips the cross-attention
# bias table that some checkpoints carry.
IGNORED = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)


def _stack(stack: str, gated: bool) -> common.KeyTable:
    """One stack's rows with its prefix: self-attention, [cross-attention,] FFN."""
    n = 2 if stack == "decoder" else 1
    ffn = [
        (o.replace("{n}", str(n)), h.replace("{n}", str(n)))
        for o, h in FFN + (FFN_GATED if gated else FFN_MLP)
    ]
    rows = STACK + (CROSS_ATTENTION if stack == "decoder" else []) + ffn
    return [(f"{stack}.{o}", f"{stack}.{h}") for o, h in rows]


def _table(cfg: ModelConfig) -> dict[str, str]:
    gated = cfg.ffn != "mlp"
    head = [] if cfg.tie_embeddings else HEAD
    return (
        common.expand(SHARED + head, 0)
        | common.expand(_stack("encoder", gated), cfg.n_layers)
        | common.expand(_stack("decoder", gated), cfg.decoder_layers)
    )


def _ffn_from_hf(proj: str) -> tuple[str, str]:
    """feed_forward_proj ("relu", "gated-gelu", ...) -> (our ffn, our activation)."""
    gated, _, act = proj.rpartition("-")
    if gated not in ("", "gated"):
        raise ValueError(f"feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
    if proj == "gated-gelu":  # HF's special case: T5 v1.1 gates with the tanh approximation
        act = "gelu_new"
    ours = common.activation_from_hf(act, "feed_forward_proj")
    if not gated:
        return "mlp", ours
    if ours == "silu":
        return "swiglu", "gelu"
    if ours in ("gelu", "gelu_tanh"):
        return "geglu", ours
    raise ValueError(f"feed_forward_proj={proj!r}: attnlab gates with SiLU or GELU only")


def config_from_hf(hf: dict) -> ModelConfig:
    """An HF T5 config.json dict -> ModelConfig (arch "encoder_decoder")."""
    ffn, act = _ffn_from_hf(common.get(hf, "feed_forward_proj", "relu"))
    tied = bool(hf.get("tie_word_embeddings", True))
    n_layers = common.get(hf, "num_layers", required=True)
    n_dec = common.get(hf, "num_decoder_layers", n_layers)
    return ModelConfig(
        arch="encoder_decoder",
        d_model=common.get(hf, "d_model", required=True),
        n_layers=n_layers,
        n_decoder_layers=None if n_dec == n_layers else n_dec,
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=common.get(hf, "n_positions", 512),
        attention=AttentionConfig(
            n_heads=common.get(hf, "num_heads", required=True),
            head_dim=common.get(hf, "d_kv", required=True),
            softmax_scale=1.0,
        ),
        position="t5_bias",
        t5_num_buckets=common.get(hf, "relative_attention_num_buckets", 32),
        t5_max_distance=common.get(hf, "relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=common.get(hf, "layer_norm_epsilon", 1e-6),
        ffn=ffn,
        activation=act,
        d_ff=common.get(hf, "d_ff", required=True),
        ffn_bias=False,
        dropout=common.get(hf, "dropout_rate", 0.0),
        tie_embeddings=tied,
        head_rescale=bool(hf.get("scale_decoder_outputs", tied)),
        init="trunc_normal",
        init_std=0.05,
    )


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field an HF T5 checkpoint cannot represent."""
    common.require(
        cfg,
        "T5",
        {
            "arch": "encoder_decoder",
            "position": "t5_bias",
            "norm": "rmsnorm",
            "norm_placement": "pre",
            "has_final_norm": True,
            "ffn_bias": False,
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "n_kv_heads": cfg.attention.n_heads,
            "attention.qk_norm": False,
            "attention.softmax_scale": 1.0,
            "attention.sliding_window": None,
            "scale_embeddings": False,
            "embed_norm": False,
            "type_vocab_size": 0,
        },
    )
    if cfg.head_rescale and not cfg.tie_embeddings:
        raise ValueError(
            "an HF T5 checkpoint cannot hold this config: head_rescale=True with "
            "tie_embeddings=False (HF rescales only a tied head)"
        )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF T5 config.json dict."""
    check_config(cfg)
    if cfg.ffn == "mlp":
        proj = common.activation_to_hf(cfg.activation)
    elif cfg.ffn == "swiglu":
        proj = "gated-silu"
    else:
        proj = {"gelu_tanh": "gated-gelu", "gelu": "gated-gelu_python"}[cfg.activation]
    hf = {
        "architectures": list(ARCHITECTURES),
        "model_type": "t5",
        "d_model": cfg.d_model,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.ffn_width,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.attention.n_heads,
        "relative_attention_num_buckets": cfg.t5_num_buckets,
        "relative_attention_max_distance": cfg.t5_max_distance,
        "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": proj,
        "vocab_size": cfg.vocab_size,
        "dropout_rate": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "dtype": "float32",
    }
    if cfg.tie_embeddings and not cfg.head_rescale:
        hf["scale_decoder_outputs"] = False
    return hf


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF T5 names (also run on a meta model for the expected keys)."""
    table = _table(cfg)
    state = common.drop_tied_aliases(model, common.model_state(model), table)
    return common.rename(state, table, what="attnlab T5 model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF T5 tensors -> our names."""
    return common.rename(state, {hf_name: ours for ours, hf_name in _table(cfg).items()})


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF T5 directory -> (EncoderDecoder in eval mode, ModelConfig)."""
    if layout != "half":
        raise ValueError(f"T5 has no RoPE; layout={layout!r} does not apply")
    hf, state = common.read_config(path), common.read_state_dict(path)
    cfg = config_from_hf(hf)
    cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "shared.weight")
    ignore = [k for k in state if k in IGNORED]
    model = common.load_checked(
        cfg,
        state,
        to_hf_state,
        from_hf_state,
        ignore,
        what=f"T5 checkpoint {str(path)!r}",
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write an EncoderDecoder as an HF T5 directory."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
