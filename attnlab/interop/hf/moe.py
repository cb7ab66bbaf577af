"""The Mixture-of-Experts decoders of the Llama lineage (HF `MixtralForCausalLM`,
`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`) <-> DecoderLM with `ModelConfig.moe`.

Their attention, norms and RoPE are the Llama family's (interop/hf/llama.py reads and writes
them); only the FFN differs, and so does each family's router (components/moe.py):

    Mixtral    softmax, top-k gates renormalised; experts w1 (gate), w3 (up), w2 (down)
               (arXiv:2401.04088; Mistral's sliding window; q/k/v/o without biases).
    Qwen2-MoE  softmax, renormalised only with norm_topk_prob; experts of moe_intermediate_size
               and one shared expert of shared_expert_intermediate_size behind a sigmoid gate
               (Qwen1.5-MoE blog, Qwen2 report arXiv:2407.10671); q/k/v biases.
    Qwen3-MoE  as Qwen2-MoE without the shared expert, with QK-norm and no biases
               (Qwen3 report arXiv:2505.09388).

HF keeps the experts as separate per-expert matrices on disk (transformers 5 fuses them into
3-D tensors only in memory), so the key table maps one Linear to one tensor, with `{j}` for the
expert. Every layer must be an MoE layer (decoder_sparse_step 1, no mlp_only_layers).
"""

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common, llama
from attnlab.models.config import ModelConfig, MoEConfig

CAUSAL_LMS = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
ARCHITECTURES = CAUSAL_LMS
# The dense family whose attention each one shares (what llama.config_from_hf reads).
DENSE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "llama"}
# (our name in an expert, the HF name) per family; {j} is the expert.
EXPERT = {
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen2_moe": ("mlp", {p: p for p in ("gate_proj", "up_proj", "down_proj")}),
    "qwen3_moe": ("mlp", {p: p for p in ("gate_proj", "up_proj", "down_proj")}),
}
QK_NORM: common.KeyTable = [
    ("blocks.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blocks.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
]
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _moe_rows(cfg: ModelConfig, family: str) -> common.KeyTable:
    """The router, the experts and (Qwen2-MoE) the gated shared expert, with {i}."""
    block, names = EXPERT[family]
    hf = f"model.layers.{{i}}.{block}"
    rows = [("blocks.{i}.ffn.router.weight", f"{hf}.gate.weight")]
    for j in range(cfg.moe.n_experts):
        rows += [
            (f"blocks.{{i}}.ffn.experts.{j}.{ours}.weight", f"{hf}.experts.{j}.{theirs}.weight")
            for ours, theirs in names.items()
        ]
    if cfg.moe.d_shared:
        rows += [
            (f"blocks.{{i}}.ffn.shared.{p}.weight", f"{hf}.shared_expert.{p}.weight")
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        rows.append(("blocks.{i}.ffn.shared_gate.weight", f"{hf}.shared_expert_gate.weight"))
    return rows


def dense_config(cfg: ModelConfig) -> ModelConfig:
    """The same model with dense FFNs and no QK-norm: what llama.py checks and writes. Mixtral
    has one width, intermediate_size, for its experts (every layer is MoE, no dense d_ff)."""
    attention = replace(cfg.attention, qk_norm=False)
    d_ff = cfg.expert_width if family_of(cfg) == "mixtral" else cfg.ffn_width
    return replace(cfg, moe=None, attention=attention, d_ff=d_ff)


def _table(cfg: ModelConfig) -> dict[str, str]:
    family = family_of(cfg)
    attention = {k: v for k, v in llama._table(dense_config(cfg)).items() if ".ffn." not in k}
    rows = _moe_rows(cfg, family) + (QK_NORM if cfg.attention.qk_norm else [])
    return attention | common.expand(rows, cfg.n_layers)


# --- configs ---------------------------------------------------------------------------------
def _moe_from_hf(hf: dict, family: str) -> MoEConfig:
    """The moe section; a field attnlab does not implement names itself."""
    if family == "mixtral":
        if common.get(hf, "router_jitter_noise", 0.0):
            raise ValueError(
                f"router_jitter_noise={hf['router_jitter_noise']} is not implemented "
                "(attnlab's routers add no noise); set it to 0.0"
            )
        return MoEConfig(
            n_experts=common.get(hf, "num_local_experts", required=True),
            n_experts_per_token=common.get(hf, "num_experts_per_tok", required=True),
        )
    if common.get(hf, "decoder_sparse_step", 1) != 1 or common.get(hf, "mlp_only_layers", []):
        raise ValueError(
            f"decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
            f"{hf.get('mlp_only_layers')}: attnlab reads {family} with an MoE in every layer "
            "(decoder_sparse_step 1, mlp_only_layers [])"
        )
    n_experts = hf.get("num_experts") or common.get(hf, "num_local_experts", required=True)
    shared = common.get(hf, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return MoEConfig(
        n_experts=n_experts,
        n_experts_per_token=common.get(hf, "num_experts_per_tok", required=True),
        d_expert=common.get(hf, "moe_intermediate_size", required=True),
        normalize=bool(hf.get("norm_topk_prob", False)),
        d_shared=shared,
        shared_gate=bool(shared),
    )


def config_from_hf(hf: dict, layout: str = "half") -> ModelConfig:
    """An HF Mixtral / Qwen2-MoE / Qwen3-MoE config.json dict -> ModelConfig."""
    family = hf.get("model_type")
    if family not in DENSE:
        raise ValueError(f"model_type {family!r} is not one of {list(DENSE)}")
    if family != "mixtral" and hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=True is not supported for {family}")
    cfg = llama.config_from_hf({**hf, "model_type": DENSE[family]}, layout)
    attention = cfg.attention
    if family == "qwen2_moe":
        attention = replace(attention, qkv_bias=bool(hf.get("qkv_bias", True)))
    if family == "qwen3_moe":
        attention = replace(attention, qk_norm=True)
    return replace(cfg, attention=attention, moe=_moe_from_hf(hf, family))


def family_of(cfg: ModelConfig) -> str:
    """qwen2_moe (a gated shared expert), qwen3_moe (QK-norm), else mixtral."""
    if cfg.moe is not None and cfg.moe.shared_gate:
        return "qwen2_moe"
    return "qwen3_moe" if cfg.attention.qk_norm else "mixtral"


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field the family's HF checkpoints cannot represent."""
    if cfg.moe is None:
        raise ValueError("a config without moe is a dense model: save it as the Llama family")
    family = family_of(cfg)
    llama.check_config(dense_config(cfg))
    expected = {
        "moe.score": "softmax",
        "moe.n_groups": 1,
        "moe.routed_scale": 1.0,
        "moe.first_dense_layers": 0,
        "head": None,
    }
    if family == "mixtral":
        expected.update({"moe.normalize": True, "moe.d_shared": 0, "attention.qkv_bias": False})
    if family == "qwen2_moe":
        expected.update({"attention.qkv_bias": True, "attention.out_bias": False})
    if family == "qwen3_moe":
        expected.update({"moe.d_shared": 0, "attention.sliding_window": None})
    common.require(cfg, family, expected)


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF config.json dict for mixtral, qwen2_moe or qwen3_moe."""
    check_config(cfg)
    family, m = family_of(cfg), cfg.moe
    hf = llama.config_to_hf(dense_config(cfg))
    for key in ("attention_bias", "mlp_bias", "use_sliding_window", "sliding_window"):
        hf.pop(key, None)
    hf.update(
        architectures=[next(k for k, v in CAUSAL_LMS.items() if v == family)],
        model_type=family,
        num_experts_per_tok=m.n_experts_per_token,
        output_router_logits=False,
    )
    if family == "mixtral":
        hf.update(
            num_local_experts=m.n_experts,
            sliding_window=cfg.attention.sliding_window,
            router_jitter_noise=0.0,
        )
        return hf
    hf.update(
        num_experts=m.n_experts,
        moe_intermediate_size=cfg.expert_width,
        norm_topk_prob=m.normalize,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    )
    if family == "qwen2_moe":
        hf.update(qkv_bias=True, shared_expert_intermediate_size=m.d_shared)
    else:
        hf["attention_bias"] = cfg.attention.qkv_bias
    return hf


# --- weights ---------------------------------------------------------------------------------
def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF names, q/k rows in the half layout (also run on a meta model)."""
    table = _table(cfg)
    state = common.apply(llama.save_transforms(cfg), common.model_state(model), cfg)
    state = common.drop_tied_aliases(model, state, table)
    return common.rename(state, table, what=f"attnlab {family_of(cfg)} model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF tensors -> our names (q/k rows permuted for an interleaved layout)."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg).items()}
    return common.apply(llama.load_transforms(cfg), common.rename(state, inverse), cfg)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF Mixtral / Qwen2-MoE / Qwen3-MoE directory -> (DecoderLM in eval mode, ModelConfig)."""
    hf, state = common.read_config(path), common.read_state_dict(path)
    cfg = config_from_hf(hf, layout)
    cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "model.embed_tokens.weight")
    ignore = [k for k in state if k.endswith(IGNORED_SUFFIXES)]
    what = f"{hf.get('model_type')} checkpoint {str(path)!r}"
    model = common.load_checked(cfg, state, to_hf_state, from_hf_state, ignore, what, dtype=dtype)
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF Mixtral / Qwen2-MoE / Qwen3-MoE directory."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
