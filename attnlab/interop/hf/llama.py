"""The Llama family (HF `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`) <-> DecoderLM,
and their `...ForSequenceClassification` <-> DecoderForSequenceClassification (`score` is our
`head`; the labels are ModelConfig.head).

Our weight names are Llama's, so the key table is almost the identity. The three differ in:
- Llama 2/3: GQA through num_key_value_heads, RoPE scaling (rope_parameters: linear, dynamic,
  yarn, llama3), `attention_bias` on all four projections, `mlp_bias`.
- Mistral: `sliding_window` -> AttentionConfig.sliding_window.
- Qwen2: q/k/v always have a bias and o_proj never does (qkv_bias=True, out_bias=False).

HF stores q_proj/k_proj rows for the "half" RoPE layout (HF's conversion script permuted Meta's
weights). Loading with layout="interleaved" permutes them (permute_qk_weight), so every attention
score, and so the logits, stay the same; saving permutes them back.
"""

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.components.positions.rope import LAYOUTS, RopeScaling, permute_qk_weight
from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig

CAUSAL_LMS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
CLASSIFIERS = {
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
}
ARCHITECTURES = {**CAUSAL_LMS, **CLASSIFIERS}

TABLE: common.KeyTable = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("blocks.{i}.residuals.0.norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blocks.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.residuals.1.norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.ffn.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.ffn.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.ffn.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
]
QKV_BIAS: common.KeyTable = [  # Qwen2 always, Llama with attention_bias
    ("blocks.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("blocks.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("blocks.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias"),
]
OUT_BIAS: common.KeyTable = [  # Llama with attention_bias
    ("blocks.{i}.self_attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias"),
]
MLP_BIAS: common.KeyTable = [  # Llama with mlp_bias
    ("blocks.{i}.ffn.gate_proj.bias", "model.layers.{i}.mlp.gate_proj.bias"),
    ("blocks.{i}.ffn.up_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
    ("blocks.{i}.ffn.down_proj.bias", "model.layers.{i}.mlp.down_proj.bias"),
]
HEAD: common.KeyTable = [("head.weight", "lm_head.weight")]  # only when untied
SCORE: common.KeyTable = [("head.weight", "score.weight")]  # a sequence classifier's head
# Older checkpoints stored the RoPE frequencies; they are recomputed, as HF does.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _table(cfg: ModelConfig) -> dict[str, str]:
    a = cfg.attention
    rows = TABLE + (QKV_BIAS if a.qkv_bias else []) + (OUT_BIAS if a.out_bias else [])
    head = SCORE if cfg.head is not None else [] if cfg.tie_embeddings else HEAD
    rows += (MLP_BIAS if cfg.ffn_bias else []) + head
    return common.expand(rows, cfg.n_layers)


def permute_qk(to: str) -> common.Transform:
    """Reorder q_proj/k_proj rows (and biases) of every layer for RoPE layout `to`."""

    def run(state: dict, cfg: ModelConfig) -> dict:
        for i in range(cfg.n_layers):
            for proj, heads in (("q_proj", cfg.attention.n_heads), ("k_proj", cfg.n_kv_heads)):
                for param in ("weight", "bias"):
                    name = f"blocks.{i}.self_attn.{proj}.{param}"
                    if name in state:
                        state[name] = permute_qk_weight(state[name], heads, cfg.head_dim, to)
        return state

    run.__name__ = f"permute_qk(to={to!r})"
    return run


def load_transforms(cfg: ModelConfig) -> list[common.Transform]:
    return [permute_qk("interleaved")] if cfg.rope.layout == "interleaved" else []


def save_transforms(cfg: ModelConfig) -> list[common.Transform]:
    return [permute_qk("half")] if cfg.rope.layout == "interleaved" else []


# --- RoPE parameters -------------------------------------------------------------------------
def _rope_params(hf: dict) -> dict:
    """rope_parameters (transformers 5) or the older rope_theta + rope_scaling, as one dict."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def scaling_from_hf(params: dict, max_positions: int) -> RopeScaling | None:
    """HF rope parameters -> RopeScaling; `max_positions` is config.json's max_position_embeddings.

    Dynamic NTK takes `max_positions` as the original length and ignores any
    `original_max_position_embeddings`, exactly as transformers does
    (`_compute_dynamic_ntk_parameters` and the rotary embedding's `original_max_seq_len`).
    """
    kind = params["rope_type"]
    original = params.get("original_max_position_embeddings", max_positions)
    factor = params.get("factor")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor, original)
    if kind == "dynamic":
        return RopeScaling("dynamic", factor, max_positions)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor,
            original,
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
        )
    if kind == "yarn":
        extra = {k: params[k] for k in ("mscale", "mscale_all_dim") if params.get(k)}
        if extra or params.get("truncate", True) is not True or factor is None:
            raise ValueError(f"YaRN options attnlab does not implement: {params}")
        return RopeScaling(
            "yarn",
            factor,
            original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            attention_factor=params.get("attention_factor"),
        )
    raise ValueError(
        f"rope_type {kind!r} is not supported; attnlab reads default, linear, "
        "dynamic, yarn and llama3"
    )


def scaling_to_hf(s: RopeScaling | None) -> dict:
    """RopeScaling -> HF rope parameters (dynamic NTK's length goes in max_position_embeddings)."""
    if s is None:
        return {"rope_type": "default"}
    if s.kind == "ntk":
        raise ValueError("HF has no static NTK RoPE scaling (only 'dynamic'); cannot save it")
    out = {"rope_type": s.kind, "factor": s.factor}
    # Linear interpolation does not use the original length; HF's dynamic NTK reads it from
    # max_position_embeddings (see config_to_hf) and warns about the key.
    if s.kind not in ("linear", "dynamic"):
        out["original_max_position_embeddings"] = s.original_max_seq_len
    if s.kind == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.kind == "yarn":
        out.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
    return out


# --- configs ---------------------------------------------------------------------------------
def _sliding_window(hf: dict, family: str) -> int | None:
    if family == "mistral":
        return hf.get("sliding_window")
    if family == "qwen2" and hf.get("use_sliding_window"):
        n, window = hf["num_hidden_layers"], hf.get("sliding_window")
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]
        if set(types) != {"sliding_attention"}:
            raise ValueError(
                f"Qwen2 with sliding attention in some layers only ({types}) is not "
                "supported: attnlab uses one window for every layer"
            )
        return window
    return None


def config_from_hf(hf: dict, layout: str = "half") -> ModelConfig:
    """An HF Llama / Mistral / Qwen2 config.json dict -> ModelConfig (RoPE in `layout`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown RoPE layout {layout!r}; expected one of {LAYOUTS}")
    family = hf.get("model_type", "llama")
    if family not in ("llama", "mistral", "qwen2"):
        raise ValueError(
            f"model_type {family!r} is not one of the Llama family (llama, mistral, qwen2)"
        )
    params = _rope_params(hf)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not "
            "supported for the Llama family"
        )
    d_model = common.get(hf, "hidden_size", required=True)
    n_heads = common.get(hf, "num_attention_heads", required=True)
    head_dim = common.get(hf, "head_dim", d_model // n_heads)
    act = common.activation_from_hf(common.get(hf, "hidden_act", "silu"), "hidden_act")
    if act == "relu":
        raise ValueError("hidden_act='relu' (a ReLU-gated MLP) is not supported")
    bias = bool(hf.get("attention_bias", False))
    qkv_bias, out_bias = (True, False) if family == "qwen2" else (bias, bias)
    max_positions = common.get(hf, "max_position_embeddings", required=True)
    return ModelConfig(
        arch="decoder",
        d_model=d_model,
        n_layers=common.get(hf, "num_hidden_layers", required=True),
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=max_positions,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=common.get(hf, "num_key_value_heads", n_heads),
            head_dim=None if head_dim == d_model // n_heads else head_dim,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            sliding_window=_sliding_window(hf, family),
        ),
        position="rope",
        rope=RopeConfig(
            theta=float(params.get("rope_theta", 10000.0)),
            layout=layout,
            scaling=scaling_from_hf(params, max_positions),
        ),
        norm="rmsnorm",
        norm_eps=common.get(hf, "rms_norm_eps", 1e-6),
        ffn="swiglu" if act == "silu" else "geglu",
        activation=act if act != "silu" else "gelu",
        d_ff=common.get(hf, "intermediate_size", required=True),
        ffn_bias=bool(hf.get("mlp_bias", False)),
        dropout=common.get(hf, "attention_dropout", 0.0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init="gpt2",
        init_std=common.get(hf, "initializer_range", 0.02),
    )


def family_of(cfg: ModelConfig) -> str:
    """Which HF model type holds `cfg`: qwen2 (q/k/v bias only), mistral (a window), or llama."""
    a = cfg.attention
    if a.qkv_bias and not a.out_bias:
        return "qwen2"
    return "mistral" if a.sliding_window is not None else "llama"


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field the HF Llama family cannot represent."""
    family = family_of(cfg)
    expected = {
        "arch": "decoder",
        "position": "rope",
        "rope.partial_rotary": 1.0,
        "norm": "rmsnorm",
        "norm_placement": "pre",
        "has_final_norm": True,
        "ffn": ("swiglu", "geglu"),
        "attention.qk_norm": False,
        "attention.softmax_scale": None,
        "scale_embeddings": False,
        "head_rescale": False,
        "embed_norm": False,
        "type_vocab_size": 0,
    }
    if family == "llama":
        expected["attention.out_bias"] = cfg.attention.qkv_bias  # one attention_bias for all four
    if family in ("qwen2", "mistral"):
        expected["ffn_bias"] = False
    if family == "qwen2":
        expected["attention.sliding_window"] = None
    if family == "mistral":
        expected["attention.qkv_bias"] = False
    common.require(cfg, family, expected)


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF config.json dict for llama, mistral or qwen2 (see `family_of`)."""
    check_config(cfg)
    family = family_of(cfg)
    # HF's dynamic NTK scales past max_position_embeddings, so that field carries our original
    # length; like every RoPE model, HF runs past max_position_embeddings without complaint.
    scaling = cfg.rope.scaling
    dynamic = scaling is not None and scaling.kind == "dynamic"
    max_positions = scaling.original_max_seq_len if dynamic else cfg.max_seq_len
    names = CAUSAL_LMS if cfg.head is None else CLASSIFIERS
    act = (
        "silu"
        if cfg.ffn == "swiglu"
        else {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.activation]
    )
    hf = {
        "architectures": [next(k for k, v in names.items() if v == family)],
        "model_type": family,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": act,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope.theta, **scaling_to_hf(cfg.rope.scaling)},
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_dropout": cfg.dropout,
        "initializer_range": cfg.init_std,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if family == "llama":
        hf.update(attention_bias=cfg.attention.qkv_bias, mlp_bias=cfg.ffn_bias)
    if family == "mistral":
        hf["sliding_window"] = cfg.attention.sliding_window
    if family == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None)
    if cfg.head is not None:
        hf.update(common.head_to_hf(cfg.head), pad_token_id=cfg.head.pad_token_id)
    return hf


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF names, q/k rows in the half layout (also run on a meta model)."""
    table = _table(cfg)
    state = common.apply(save_transforms(cfg), common.model_state(model), cfg)
    state = common.drop_tied_aliases(model, state, table)
    return common.rename(state, table, what=f"attnlab {family_of(cfg)} model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF Llama-family tensors -> our names (q/k rows permuted for an interleaved layout)."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg).items()}
    return common.apply(load_transforms(cfg), common.rename(state, inverse), cfg)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF Llama / Mistral / Qwen2 directory -> (DecoderLM, or DecoderForSequenceClassification
    for a ...ForSequenceClassification, in eval mode; ModelConfig)."""
    hf, state = common.read_config(path), common.read_state_dict(path)
    cfg = config_from_hf(hf, layout)
    if any(a in CLASSIFIERS for a in hf.get("architectures") or []):
        cfg = replace(cfg, head=common.head_from_hf(hf, "sequence", hf.get("pad_token_id")))
    else:
        cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "model.embed_tokens.weight")
    ignore = [k for k in state if k.endswith(IGNORED_SUFFIXES)]
    what = f"{hf.get('model_type', 'llama')} checkpoint {str(path)!r}"
    model = common.load_checked(cfg, state, to_hf_state, from_hf_state, ignore, what, dtype=dtype)
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF Llama / Mistral / Qwen2 directory (q/k rows in the half layout)."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
