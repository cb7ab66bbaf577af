"""The newer Llama-shaped families <-> DecoderLM: Qwen3, OLMo 2, Phi-3, Gemma 2, Gemma 3 (text).

Each is a Llama (interop/hf/llama.py reads what they share: widths, GQA, RoPE and its scaling,
biases, tying) plus a few of the components that came after it:

    family       HF class             what it adds to a Llama
    qwen3        Qwen3ForCausalLM     QK-norm per head (RMSNorm of head_dim)
    olmo2        Olmo2ForCausalLM     QK-norm over the whole projection; norms on the sublayer
                                      outputs only (post_attention / post_feedforward_layernorm)
    phi3         Phi3ForCausalLM      fused qkv_proj and gate_up_proj; partial rotary; a window
    gemma2       Gemma2ForCausalLM    sandwich norms, (1 + w) RMSNorm, embeddings * sqrt(d_model),
                                      GeGLU (tanh GELU), query_pre_attn_scalar, alternating
                                      sliding/global layers, attention and final logit soft-caps
    gemma3_text  Gemma3ForCausalLM    Gemma 2 without the soft-caps (by default), QK-norm per
                                      head, 5 sliding : 1 global, local layers' own RoPE base

Sources: the transformers modeling files of each family (modeling_qwen3.py, modeling_olmo2.py,
modeling_phi3.py, modeling_gemma2.py, modeling_gemma3.py); Qwen3 Technical Report
(arXiv:2505.09388), OLMo 2 (arXiv:2501.00656), Phi-3 (arXiv:2404.14219), Gemma 2
(arXiv:2408.00118), Gemma 3 (arXiv:2503.19786).

Saving picks the family from the config's components (`family_of`); a config that none of them
needs is a Llama (llama.py), so a Phi-3 with full rotary saves as the Llama it computes.
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common, llama
from attnlab.models.config import ModelConfig

CAUSAL_LMS = {
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
ARCHITECTURES = CAUSAL_LMS
MODEL_TYPES = tuple(CAUSAL_LMS.values())
GEMMA = ("gemma2", "gemma3_text")

# --- key tables ------------------------------------------------------------------------------
LAYER = "model.layers.{i}"
QK_NORM: common.KeyTable = [
    ("blocks.{i}.self_attn.q_norm.weight", f"{LAYER}.self_attn.q_norm.weight"),
    ("blocks.{i}.self_attn.k_norm.weight", f"{LAYER}.self_attn.k_norm.weight"),
]
# Each family's norms: (our Residual's norm, HF's name). Our residuals.0 is attention, .1 the FFN.
NORMS = {
    "llama": [
        ("blocks.{i}.residuals.0.norm.weight", f"{LAYER}.input_layernorm.weight"),
        ("blocks.{i}.residuals.1.norm.weight", f"{LAYER}.post_attention_layernorm.weight"),
    ],
    "olmo2": [
        ("blocks.{i}.residuals.0.out_norm.weight", f"{LAYER}.post_attention_layernorm.weight"),
        ("blocks.{i}.residuals.1.out_norm.weight", f"{LAYER}.post_feedforward_layernorm.weight"),
    ],
    "gemma": [
        ("blocks.{i}.residuals.0.norm.weight", f"{LAYER}.input_layernorm.weight"),
        ("blocks.{i}.residuals.0.out_norm.weight", f"{LAYER}.post_attention_layernorm.weight"),
        ("blocks.{i}.residuals.1.norm.weight", f"{LAYER}.pre_feedforward_layernorm.weight"),
        ("blocks.{i}.residuals.1.out_norm.weight", f"{LAYER}.post_feedforward_layernorm.weight"),
    ],
}
# Phi-3 fuses q/k/v and gate/up; the transforms below split and join them under these names.
PHI3_FUSED: common.KeyTable = [
    ("blocks.{i}.self_attn.qkv_proj.weight", f"{LAYER}.self_attn.qkv_proj.weight"),
    ("blocks.{i}.ffn.gate_up_proj.weight", f"{LAYER}.mlp.gate_up_proj.weight"),
]
QKV = [f"blocks.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
GATE_UP = ["blocks.{i}.ffn.gate_proj.weight", "blocks.{i}.ffn.up_proj.weight"]


def _norm_rows(family: str) -> common.KeyTable:
    return NORMS["olmo2" if family == "olmo2" else "gemma" if family in GEMMA else "llama"]


def _table(cfg: ModelConfig, family: str) -> dict[str, str]:
    """{our name: HF name} for `cfg` saved as `family`; Phi-3's fused projections appear under
    the fused names the transforms give them (qkv_proj, gate_up_proj)."""
    rows = [(ours, theirs) for ours, theirs in llama.TABLE if ".residuals." not in ours]
    if family == "phi3":
        rows = [r for r in rows if r[0] not in QKV + GATE_UP] + PHI3_FUSED
    rows += _norm_rows(family) + (QK_NORM if cfg.attention.qk_norm else [])
    rows += llama.QKV_BIAS + llama.OUT_BIAS if cfg.attention.qkv_bias else []
    rows += [] if cfg.tie_embeddings else llama.HEAD
    return common.expand(rows, cfg.n_layers)


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    return [cfg.attention.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2


def _transforms(cfg: ModelConfig, family: str, to_hf: bool) -> list[common.Transform]:
    """Phi-3's fusing (to HF) or splitting (from HF), and llama's RoPE-layout permutation."""
    steps = (llama.save_transforms if to_hf else llama.load_transforms)(cfg)
    if family != "phi3":
        return steps
    qkv, gate_up = PHI3_FUSED[0][0], PHI3_FUSED[1][0]
    if to_hf:  # permute q/k rows first (they are still apart), then fuse
        return steps + [common.fuse_rows(QKV, qkv), common.fuse_rows(GATE_UP, gate_up)]
    split = [common.split_rows(qkv, QKV, _qkv_sizes), common.split_rows(gate_up, GATE_UP, _halves)]
    return split + steps  # split first, then permute q/k rows


def _halves(cfg: ModelConfig) -> list[int]:
    return [cfg.ffn_width, cfg.ffn_width]  # gate first: HF's `gate, up = x.chunk(2, dim=-1)`


# --- configs ---------------------------------------------------------------------------------
def _family(hf: dict) -> str:
    for arch in hf.get("architectures") or []:
        if arch in CAUSAL_LMS:
            return CAUSAL_LMS[arch]
    family = hf.get("model_type")
    if family not in MODEL_TYPES:
        raise ValueError(f"model_type {family!r} is not one of {list(MODEL_TYPES)}")
    return family


def config_from_hf(hf: dict, layout: str = "half") -> ModelConfig:
    """An HF config.json dict of one of these families -> ModelConfig (RoPE in `layout`)."""
    family = _family(hf)
    view = {**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if family in GEMMA:
        return _gemma_from_hf(hf, view, family, layout)
    if family == "phi3":
        return _phi3_from_hf(hf, view, layout)
    base = llama.config_from_hf(view, layout)
    if family == "qwen3":
        window = llama._sliding_window({**hf, "model_type": "qwen2"}, "qwen2")
        attention = replace(base.attention, qk_norm=True, sliding_window=window)
        return replace(base, attention=attention)
    attention = replace(base.attention, qk_norm=True, qk_norm_scope="projection")  # olmo2
    return replace(base, attention=attention, norm_placement="post_sublayer")


def _phi3_from_hf(hf: dict, view: dict, layout: str) -> ModelConfig:
    params = llama._rope_params(hf)
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    base = llama.config_from_hf({**view, "rope_parameters": params, "rope_scaling": None}, layout)
    attention = replace(base.attention, sliding_window=hf.get("sliding_window"))
    return replace(base, attention=attention, rope=replace(base.rope, partial_rotary=partial))


def _pattern_from_hf(types: list[str], family: str) -> tuple[bool, int | None]:
    """layer_types -> (any sliding layer, global_every): n - 1 sliding layers then one full,
    repeated; every layer sliding; or every layer full. Any other pattern is refused."""
    if set(types) == {"full_attention"}:
        return False, None
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else None
    want = [layer_type(every is None or (i + 1) % every != 0) for i in range(len(types))]
    if types != want:
        raise ValueError(
            f"{family} layer_types={types} is not a repeating run of sliding layers closed by "
            "one full_attention layer, the only pattern attnlab implements"
        )
    return True, every


def layer_type(local: bool) -> str:
    return "sliding_attention" if local else "full_attention"


def _gemma_rope(hf: dict, family: str, local: bool) -> dict:
    """The RoPE parameters of the local or the global layers: Gemma 3 keeps one set per layer
    type (or, in older files, rope_local_base_freq beside rope_theta); Gemma 2 one set."""
    if family != "gemma3_text":
        return llama._rope_params(hf)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["sliding_attention" if local else "full_attention"]
    elif local:
        params = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    else:
        params = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
    return llama._rope_params({"rope_parameters": params})


def _gemma_from_hf(hf: dict, view: dict, family: str, layout: str) -> ModelConfig:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            f"{family} use_bidirectional_attention=True is not implemented: attnlab's Gemma "
            "decoders are causal"
        )
    n = common.get(hf, "num_hidden_layers", required=True)
    period = hf.get("sliding_window_pattern", 2 if family == "gemma2" else 6)  # older files
    types = hf.get("layer_types") or [layer_type((i + 1) % period != 0) for i in range(n)]
    windowed, every = _pattern_from_hf(list(types), family)
    glob, local = _gemma_rope(hf, family, False), _gemma_rope(hf, family, True)
    both = windowed and every is not None and local != glob  # two RoPEs, one per layer type
    if both and local["rope_type"] != "default":
        raise ValueError(
            f"{family} sliding_attention rope_type={local['rope_type']!r} is not implemented: "
            "attnlab rotates local layers without scaling"
        )
    view.update(
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        rope_parameters=local if windowed and every is None else glob,  # all sliding: local
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
    )
    base = llama.config_from_hf(view, layout)
    softcap = hf.get("attn_logit_softcapping")
    if family == "gemma3_text" and softcap is not None:  # transformers stores it, never applies it
        print(
            f"warning: gemma3_text attn_logit_softcapping={softcap} is ignored, as "
            "transformers' Gemma3ForCausalLM ignores it: attention logits are not soft-capped",
            file=sys.stderr,
        )
        softcap = None
    scalar = common.get(hf, "query_pre_attn_scalar", base.head_dim)
    attention = replace(
        base.attention,
        qk_norm=family == "gemma3_text",
        softmax_scale=None if scalar == base.head_dim else scalar**-0.5,
        sliding_window=hf.get("sliding_window") if windowed else None,
        global_every=every,
        logit_softcap=softcap,
        backend="eager" if softcap is not None else base.attention.backend,
    )
    return replace(
        base,
        attention=attention,
        rope=replace(base.rope, local_theta=float(local["rope_theta"]) if both else None),
        norm_placement="sandwich",
        norm_unit_offset=True,
        scale_embeddings=True,
        logit_softcap=hf.get("final_logit_softcapping"),
    )


def family_of(cfg: ModelConfig) -> str | None:
    """The family here that holds `cfg`, or None when a plain Llama does (llama.py)."""
    if cfg.norm_unit_offset:
        return "gemma3_text" if cfg.attention.qk_norm else "gemma2"
    if cfg.norm_placement == "post_sublayer":
        return "olmo2"
    if cfg.attention.qk_norm:
        return "qwen3"
    if cfg.rope.partial_rotary != 1.0:
        return "phi3"
    return None


# What each family changes of a Llama's fields (ANY: whatever the config holds).
ANY = object()
LLAMA_VALUES = {
    "attention.qk_norm": False,
    "attention.qk_norm_scope": "head",
    "attention.softmax_scale": None,
    "attention.sliding_window": None,
    "attention.global_every": None,
    "attention.logit_softcap": None,
    "rope.partial_rotary": 1.0,
    "rope.local_theta": None,
    "norm_placement": "pre",
    "norm_unit_offset": False,
    "scale_embeddings": False,
    "logit_softcap": None,
    "ffn_bias": False,
}
GEMMA2 = {
    "attention.softmax_scale": ANY,
    "attention.sliding_window": ANY,
    "attention.global_every": ANY,
    "attention.logit_softcap": ANY,
    "norm_placement": "sandwich",
    "norm_unit_offset": True,
    "scale_embeddings": True,
    "logit_softcap": ANY,
}
CHANGES = {
    "qwen3": {"attention.qk_norm": True, "attention.sliding_window": ANY},
    "olmo2": {
        "attention.qk_norm": True,
        "attention.qk_norm_scope": "projection",
        "norm_placement": "post_sublayer",
    },
    "phi3": {"rope.partial_rotary": ANY, "attention.sliding_window": ANY},
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA2 | {"attention.qk_norm": True, "rope.local_theta": ANY},
}


def check_config(cfg: ModelConfig, family: str) -> None:
    """ValueError naming every field an HF `family` checkpoint cannot hold (see llama's too)."""
    expected = {
        k: _field(cfg, k) if v is ANY else v for k, v in (LLAMA_VALUES | CHANGES[family]).items()
    }
    expected["attention.out_bias"] = cfg.attention.qkv_bias  # one attention_bias for all four
    expected["head"] = None  # only the ...ForCausalLM classes here
    if family == "phi3":
        expected["attention.qkv_bias"] = False
    common.require(cfg, family, expected)


def _field(cfg: ModelConfig, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _llama_view(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with every field of LLAMA_VALUES at its Llama value: what llama.py writes."""
    a, r = cfg.attention, cfg.rope
    attention = replace(
        a,
        qk_norm=False,
        qk_norm_scope="head",
        softmax_scale=None,
        sliding_window=None,
        global_every=None,
        logit_softcap=None,
        backend="sdpa",
    )
    return replace(
        cfg,
        attention=attention,
        rope=replace(r, partial_rotary=1.0, local_theta=None),
        norm_placement="pre",
        norm_unit_offset=False,
        scale_embeddings=False,
        logit_softcap=None,
    )


def config_to_hf(cfg: ModelConfig, family: str | None = None) -> dict:
    """ModelConfig -> an HF config.json dict of `family` (default: `family_of(cfg)`)."""
    family = family or family_of(cfg)
    check_config(cfg, family)
    hf = llama.config_to_hf(_llama_view(cfg))
    arch = next(k for k, v in CAUSAL_LMS.items() if v == family)
    hf.update(architectures=[arch], model_type=family)
    hf.pop("mlp_bias", None)
    window = cfg.attention.sliding_window
    if family == "qwen3":
        hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
    if family == "phi3":
        hf.pop("attention_bias")
        hf["rope_parameters"]["partial_rotary_factor"] = cfg.rope.partial_rotary
        hf["sliding_window"] = window
    if family in GEMMA:
        _gemma_to_hf(cfg, family, hf)
    return hf


def _gemma_to_hf(cfg: ModelConfig, family: str, hf: dict) -> None:
    a = cfg.attention
    scalar = cfg.head_dim if a.softmax_scale is None else a.softmax_scale**-2
    hf.update(
        hidden_activation=hf.pop("hidden_act"),
        query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        sliding_window=a.sliding_window,
        layer_types=[layer_type(a.is_local(i)) for i in range(cfg.n_layers)],
        attn_logit_softcapping=a.logit_softcap,
        final_logit_softcapping=cfg.logit_softcap,
    )
    if family == "gemma3_text":
        glob, theta = hf["rope_parameters"], cfg.rope.local_theta  # local: no scaling
        local = glob if theta is None else {"rope_type": "default", "rope_theta": theta}
        hf["rope_parameters"] = {"full_attention": glob, "sliding_attention": local}


# --- weights ---------------------------------------------------------------------------------
def to_hf_state(model: nn.Module, cfg: ModelConfig, family: str | None = None) -> dict:
    """Our state dict -> HF names of `family` (default `family_of(cfg)`; also on a meta model)."""
    family = family or family_of(cfg)
    table = _table(cfg, family)
    state = common.apply(_transforms(cfg, family, True), common.model_state(model), cfg)
    state = common.drop_tied_aliases(model, state, table)
    return common.rename(state, table, what=f"attnlab {family} model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig, family: str) -> dict[str, Tensor]:
    """HF tensors of `family` -> our names (Phi-3's fused projections split)."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg, family).items()}
    return common.apply(_transforms(cfg, family, False), common.rename(state, inverse), cfg)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF Qwen3 / OLMo 2 / Phi-3 / Gemma 2 / Gemma 3 directory -> (DecoderLM in eval mode,
    ModelConfig)."""
    hf, state = common.read_config(path), common.read_state_dict(path)
    family = _family(hf)
    cfg = config_from_hf(hf, layout)
    cfg, state = common.resolve_tie(cfg, state, "lm_head.weight", "model.embed_tokens.weight")
    ignore = [k for k in state if k.endswith(llama.IGNORED_SUFFIXES)]
    model = common.load_checked(
        cfg,
        state,
        lambda m, c: to_hf_state(m, c, family),
        lambda s, c: from_hf_state(s, c, family),
        ignore,
        f"{family} checkpoint {str(path)!r}",
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write `model` as an HF directory of the family that holds it (`family_of`)."""
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
