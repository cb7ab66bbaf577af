"""DeepSeek-V3 (HF `DeepseekV3ForCausalLM`, arXiv:2412.19437) <-> DecoderLM with MLA attention
(components/mla.py) and DeepSeekMoE FFNs (components/moe.py).

    attention   MLA: kv_a_proj_with_mqa -> [latent | rope key], kv_a_layernorm, kv_b_proj;
                queries through q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank)
    FFN         the first first_k_dense_replace layers a dense SwiGLU (intermediate_size); then
                n_routed_experts SwiGLU experts of moe_intermediate_size, sigmoid affinities,
                the top num_experts_per_tok chosen on affinity + e_score_correction_bias within
                the topk_group best of n_group groups, gates normalised (norm_topk_prob) and
                scaled by routed_scaling_factor, plus n_shared_experts shared experts (one FFN
                of n_shared_experts * moe_intermediate_size)

rope_interleave=True (DeepSeek's checkpoints) rotates the rope part in interleaved pairs: our
"interleaved" RoPE layout, with no weight permutation (HF reorders q and k the same way after
the rotation, which leaves every score as it is). The multi-token-prediction layers
(num_nextn_predict_layers) are not part of HF's model either and are not read. YaRN with
mscale (the released 128K config) is refused, naming the field: attnlab's YaRN has no mscale.
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common, llama
from attnlab.models.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig

CAUSAL_LMS = {"DeepseekV3ForCausalLM": "deepseek_v3"}
ARCHITECTURES = CAUSAL_LMS
ATTENTION = {  # our MLA module names -> HF's (the rest are the same)
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "q_a_norm": "q_a_layernorm",
}
SWIGLU = ("gate_proj", "up_proj", "down_proj")
TOP: common.KeyTable = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
]
HEAD: common.KeyTable = [("head.weight", "lm_head.weight")]  # only when untied


def _attention_rows(cfg: ModelConfig) -> common.KeyTable:
    names = ["kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"]
    names += (
        ["q_proj"] if cfg.attention.q_lora_rank is None else ["q_a_proj", "q_a_norm", "q_b_proj"]
    )
    hf = "model.layers.{i}"
    rows = [
        (f"blocks.{{i}}.self_attn.{n}.weight", f"{hf}.self_attn.{ATTENTION.get(n, n)}.weight")
        for n in names
    ]
    return rows + [
        ("blocks.{i}.residuals.0.norm.weight", f"{hf}.input_layernorm.weight"),
        ("blocks.{i}.residuals.1.norm.weight", f"{hf}.post_attention_layernorm.weight"),
    ]


def _ffn_rows(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Layer i's FFN: dense (the first layers) or the router, its bias and the experts."""
    ours, hf = f"blocks.{i}.ffn", f"model.layers.{i}.mlp"
    if i < cfg.moe.first_dense_layers:
        return {f"{ours}.{p}.weight": f"{hf}.{p}.weight" for p in SWIGLU}
    rows = {f"{ours}.router.weight": f"{hf}.gate.weight"}
    rows[f"{ours}.router_bias"] = f"{hf}.gate.e_score_correction_bias"
    for j in range(cfg.moe.n_experts):
        rows |= {f"{ours}.experts.{j}.{p}.weight": f"{hf}.experts.{j}.{p}.weight" for p in SWIGLU}
    return rows | {f"{ours}.shared.{p}.weight": f"{hf}.shared_experts.{p}.weight" for p in SWIGLU}


def _table(cfg: ModelConfig) -> dict[str, str]:
    rows = TOP + _attention_rows(cfg) + ([] if cfg.tie_embeddings else HEAD)
    table = common.expand(rows, cfg.n_layers)
    for i in range(cfg.n_layers):
        table |= _ffn_rows(cfg, i)
    return table


# --- configs ---------------------------------------------------------------------------------
def _check_hf(hf: dict) -> None:
    """ValueError naming the config.json field attnlab does not implement."""
    n_heads = common.get(hf, "num_attention_heads", required=True)
    unsupported = {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "num_key_value_heads": common.get(hf, "num_key_value_heads", n_heads) != n_heads,
        "hidden_act": common.get(hf, "hidden_act", "silu") != "silu",
        "n_shared_experts": common.get(hf, "n_shared_experts", 1) < 1,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        fields = ", ".join(f"{k}={hf.get(k)!r}" for k in bad)
        raise ValueError(
            f"deepseek_v3 fields attnlab does not implement: {fields} "
            "(it reads attention_bias false, num_key_value_heads = num_attention_heads, "
            "hidden_act silu, n_shared_experts >= 1)"
        )


def config_from_hf(hf: dict, layout: str | None = None) -> ModelConfig:
    """An HF DeepSeek-V3 config.json dict -> ModelConfig (layout: from rope_interleave)."""
    _check_hf(hf)
    params = llama._rope_params(hf)
    max_positions = common.get(hf, "max_position_embeddings", required=True)
    d_expert = common.get(hf, "moe_intermediate_size", required=True)
    interleave = bool(hf.get("rope_interleave", True))
    return ModelConfig(
        arch="decoder",
        d_model=common.get(hf, "hidden_size", required=True),
        n_layers=common.get(hf, "num_hidden_layers", required=True),
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=max_positions,
        attention=AttentionConfig(
            n_heads=common.get(hf, "num_attention_heads", required=True),
            kind="mla",
            kv_lora_rank=common.get(hf, "kv_lora_rank", required=True),
            q_lora_rank=hf.get("q_lora_rank"),
            qk_rope_head_dim=common.get(hf, "qk_rope_head_dim", required=True),
            qk_nope_head_dim=common.get(hf, "qk_nope_head_dim", required=True),
            v_head_dim=common.get(hf, "v_head_dim", required=True),
        ),
        position="rope",
        rope=RopeConfig(
            theta=float(params.get("rope_theta", 10000.0)),
            layout="interleaved" if interleave else "half",
            scaling=llama.scaling_from_hf(params, max_positions),
        ),
        norm="rmsnorm",
        norm_eps=common.get(hf, "rms_norm_eps", 1e-6),
        ffn="swiglu",
        d_ff=common.get(hf, "intermediate_size", required=True),
        dropout=common.get(hf, "attention_dropout", 0.0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=common.get(hf, "initializer_range", 0.02),
        moe=MoEConfig(
            n_experts=hf.get("n_routed_experts")
            or common.get(hf, "num_local_experts", required=True),
            n_experts_per_token=common.get(hf, "num_experts_per_tok", required=True),
            d_expert=d_expert,
            score="sigmoid",
            normalize=bool(hf.get("norm_topk_prob", True)),
            n_groups=common.get(hf, "n_group", 1),
            topk_groups=common.get(hf, "topk_group", 1),
            routed_scale=float(common.get(hf, "routed_scaling_factor", 1.0)),
            d_shared=common.get(hf, "n_shared_experts", 1) * d_expert,
            first_dense_layers=common.get(hf, "first_k_dense_replace", 0),
        ),
    )


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field a DeepSeek-V3 checkpoint cannot represent."""
    m = cfg.moe
    expected = {
        "arch": "decoder",
        "attention.kind": "mla",
        "attention.out_bias": False,
        "position": "rope",
        "norm": "rmsnorm",
        "norm_placement": "pre",
        "has_final_norm": True,
        "ffn": "swiglu",
        "scale_embeddings": False,
        "embed_norm": False,
        "head": None,
        "moe.score": "sigmoid",
        "moe.shared_gate": False,
    }
    common.require(cfg, "deepseek_v3", expected)
    if m.d_shared < 1 or m.d_shared % cfg.expert_width:
        raise ValueError(
            f"moe.d_shared={m.d_shared} must be a positive multiple of the expert width "
            f"{cfg.expert_width} (DeepSeek-V3 counts n_shared_experts)"
        )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF DeepSeek-V3 config.json dict."""
    check_config(cfg)
    a, m = cfg.attention, cfg.moe
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_width,
        "moe_intermediate_size": cfg.expert_width,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads,
        "kv_lora_rank": a.kv_lora_rank,
        "q_lora_rank": a.q_lora_rank,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "v_head_dim": a.v_head_dim,
        "head_dim": a.qk_rope_head_dim,
        "n_routed_experts": m.n_experts,
        "num_experts_per_tok": m.n_experts_per_token,
        "n_shared_experts": m.d_shared // cfg.expert_width,
        "n_group": m.n_groups,
        "topk_group": m.topk_groups,
        "norm_topk_prob": m.normalize,
        "routed_scaling_factor": m.routed_scale,
        "first_k_dense_replace": m.first_dense_layers,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope.theta, **llama.scaling_to_hf(cfg.rope.scaling)},
        "rope_interleave": cfg.rope.layout == "interleaved",
        "attention_bias": False,
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


# --- weights ---------------------------------------------------------------------------------
def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF names (also run on a meta model)."""
    table = _table(cfg)
    state = common.drop_tied_aliases(model, common.model_state(model), table)
    return common.rename(state, table, what="attnlab deepseek_v3 model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return common.rename(state, {hf: ours for ours, hf in _table(cfg).items()})


def load_hf(path: str | Path, layout: str | None = None, dtype: torch.dtype | None = None):
    """An HF DeepSeek-V3 directory -> (DecoderLM in eval mode, ModelConfig). The RoPE layout
    follows rope_interleave (a `layout` argument is accepted for the common signature only)."""
    hf, state = common.read_config(path), common.read_state_dict(path)
    cfg = config_from_hf(hf)
    cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "model.embed_tokens.weight")
    what = f"deepseek_v3 checkpoint {str(path)!r}"
    model = common.load_checked(cfg, state, to_hf_state, from_hf_state, (), what, dtype=dtype)
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF DeepSeek-V3 directory."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
