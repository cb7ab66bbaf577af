"""BERT (HF `BertForMaskedLM`, `BertFor{Sequence,Token}Classification`) <-> attnlab encoders.

    BertForMaskedLM                -> EncoderForMLM                  (cls.predictions.* -> head.*)
    BertForSequenceClassification  -> EncoderForClassification       (bert.pooler, classifier)
    BertForTokenClassification     -> EncoderForTokenClassification  (classifier; no pooler)

A classifier's labels (config.json id2label) are ModelConfig.head.labels.

BERT is post-norm: each sublayer's LayerNorm (`attention.output.LayerNorm`, `output.LayerNorm`)
comes after its residual sum, which is our Residual with placement "post". The LayerNorm BERT
applies to the summed word + position + segment embeddings is our `encoder.embed_norm`.
The MLM decoder is tied to the word embeddings; its bias is `cls.predictions.bias`.

Config: huggingface.co/google-bert/bert-base-uncased/config.json.
"""

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.heads import config_with_head

# HF architecture -> our head task (None: the masked-LM model).
ARCHITECTURES = {
    "BertForMaskedLM": None,
    "BertForSequenceClassification": "sequence",
    "BertForTokenClassification": "token",
}

EMBEDDINGS: common.KeyTable = [
    ("encoder.embed.weight", "bert.embeddings.word_embeddings.weight"),
    ("encoder.positions.table.weight", "bert.embeddings.position_embeddings.weight"),
    ("encoder.type_embed.weight", "bert.embeddings.token_type_embeddings.weight"),
    ("encoder.embed_norm.weight", "bert.embeddings.LayerNorm.weight"),
    ("encoder.embed_norm.bias", "bert.embeddings.LayerNorm.bias"),
]
# Each layer's modules (ours under encoder.blocks.{i}, HF's under bert.encoder.layer.{i}); each
# has a weight and a bias.
LAYER_MODULES = [
    ("self_attn.q_proj", "attention.self.query"),
    ("self_attn.k_proj", "attention.self.key"),
    ("self_attn.v_proj", "attention.self.value"),
    ("self_attn.o_proj", "attention.output.dense"),
    ("residuals.0.norm", "attention.output.LayerNorm"),  # post-norm: after the residual sum
    ("ffn.up_proj", "intermediate.dense"),
    ("ffn.down_proj", "output.dense"),
    ("residuals.1.norm", "output.LayerNorm"),
]
ENCODER: common.KeyTable = EMBEDDINGS + [
    (f"encoder.blocks.{{i}}.{ours}.{p}", f"bert.encoder.layer.{{i}}.{theirs}.{p}")
    for ours, theirs in LAYER_MODULES
    for p in ("weight", "bias")
]
MLM_HEAD: common.KeyTable = [
    ("head.dense.weight", "cls.predictions.transform.dense.weight"),
    ("head.dense.bias", "cls.predictions.transform.dense.bias"),
    ("head.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("head.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("head.decoder.bias", "cls.predictions.bias"),
]
MLM_DECODER: common.KeyTable = [("head.decoder.weight", "cls.predictions.decoder.weight")]  # untied
TOKEN_CLASSIFIER: common.KeyTable = [
    ("classifier.weight", "classifier.weight"),
    ("classifier.bias", "classifier.bias"),
]
CLASSIFIER: common.KeyTable = [
    ("pooler.weight", "bert.pooler.dense.weight"),
    ("pooler.bias", "bert.pooler.dense.bias"),
] + TOKEN_CLASSIFIER
# What HF itself skips: a buffer, the decoder bias stored twice, and the parts of a
# BertForPreTraining checkpoint that a masked-LM model has no use for.
IGNORED = (
    "bert.embeddings.position_ids",
    "bert.embeddings.token_type_ids",
    "cls.predictions.decoder.bias",
)
IGNORED_MLM_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")


def config_from_hf(hf: dict) -> ModelConfig:
    """An HF BERT config.json dict -> ModelConfig (arch "encoder")."""
    unsupported = {k: hf[k] for k in ("is_decoder", "add_cross_attention") if hf.get(k)}
    if hf.get("position_embedding_type", "absolute") != "absolute":
        unsupported["position_embedding_type"] = hf["position_embedding_type"]
    if unsupported:
        raise ValueError(f"BERT options attnlab does not implement: {unsupported}")
    return ModelConfig(
        arch="encoder",
        d_model=common.get(hf, "hidden_size", required=True),
        n_layers=common.get(hf, "num_hidden_layers", required=True),
        vocab_size=common.get(hf, "vocab_size", required=True),
        max_seq_len=common.get(hf, "max_position_embeddings", required=True),
        attention=AttentionConfig(
            n_heads=common.get(hf, "num_attention_heads", required=True),
            qkv_bias=True,
            out_bias=True,
        ),
        position="learned",
        norm="layernorm",
        norm_placement="post",
        norm_eps=common.get(hf, "layer_norm_eps", 1e-12),
        ffn="mlp",
        activation=common.activation_from_hf(common.get(hf, "hidden_act", "gelu"), "hidden_act"),
        d_ff=common.get(hf, "intermediate_size", required=True),
        ffn_bias=True,
        dropout=common.get(hf, "hidden_dropout_prob", 0.0),
        embed_norm=True,
        type_vocab_size=common.get(hf, "type_vocab_size", 2),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        init="trunc_normal",
        init_std=common.get(hf, "initializer_range", 0.02),
    )


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming every field an HF BERT checkpoint cannot represent."""
    common.require(
        cfg,
        "BERT",
        {
            "arch": "encoder",
            "position": "learned",
            "norm": "layernorm",
            "norm_bias": True,
            "norm_placement": "post",
            "has_final_norm": False,
            "ffn": "mlp",
            "ffn_bias": True,
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "n_kv_heads": cfg.attention.n_heads,
            "head_dim": cfg.d_model // cfg.attention.n_heads,
            "attention.qk_norm": False,
            "attention.softmax_scale": None,
            "scale_embeddings": False,
            "embed_norm": True,
        },
    )
    if cfg.head is not None and cfg.head.pooling != "cls":
        raise ValueError(
            f"an HF BERT checkpoint cannot hold this config: head.pooling={cfg.head.pooling!r} "
            "(BertForSequenceClassification pools the [CLS] token; train with pooling 'cls')"
        )
    if cfg.type_vocab_size < 1:
        raise ValueError(
            "an HF BERT checkpoint cannot hold this config: type_vocab_size=0 "
            "(BERT always has segment embeddings; needs >= 1)"
        )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF BERT config.json dict (a classifier when cfg.head is set)."""
    check_config(cfg)
    task = None if cfg.head is None else cfg.head.task
    hf = {
        "architectures": [next(a for a, t in ARCHITECTURES.items() if t == task)],
        "model_type": "bert",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "intermediate_size": cfg.ffn_width,
        "hidden_act": common.activation_to_hf(cfg.activation),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "dtype": "float32",
        "pad_token_id": 0,
    }
    if cfg.head is not None:
        hf.update(common.head_to_hf(cfg.head))
    return hf


def _table(cfg: ModelConfig) -> dict[str, str]:
    if cfg.head is None:
        head = MLM_HEAD + ([] if cfg.tie_embeddings else MLM_DECODER)
    else:
        head = CLASSIFIER if cfg.head.task == "sequence" else TOKEN_CLASSIFIER
    return common.expand(ENCODER + head, cfg.n_layers)


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF BERT names (also run on a meta model for the expected keys)."""
    table = _table(config_with_head(cfg, model))
    state = common.drop_tied_aliases(model, common.model_state(model), table)
    return common.rename(state, table, what="attnlab BERT model")


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF BERT tensors -> our names."""
    inverse = {hf_name: ours for ours, hf_name in _table(cfg).items()}
    return common.rename(state, inverse)


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF BERT directory -> (EncoderForMLM, or the classifier of cfg.head, in eval mode; cfg)."""
    if layout != "half":
        raise ValueError(f"BERT has no RoPE; layout={layout!r} does not apply")
    hf, state = common.read_config(path), common.read_state_dict(path)
    arch = (hf.get("architectures") or ["BertForMaskedLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"BERT architecture {arch!r} is not supported; choose from {sorted(ARCHITECTURES)}"
        )
    task = ARCHITECTURES[arch]
    cfg = config_from_hf(hf)
    if task is None:
        cfg, state = common.resolve_tie(
            cfg, state, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
        )
    else:
        cfg = replace(cfg, head=common.head_from_hf(hf, task))
    # A token classifier has no pooler (a base model's may be stored), a masked-LM model no
    # pooler nor next-sentence head.
    skipped = {None: IGNORED_MLM_PREFIXES, "token": ("bert.pooler.",), "sequence": ()}[task]
    ignore = [k for k in state if k in IGNORED or k.startswith(skipped)]
    model = common.load_checked(
        cfg,
        state,
        to_hf_state,
        from_hf_state,
        ignore,
        what=f"BERT checkpoint {str(path)!r}",
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write an EncoderForMLM or an encoder with a task head as an HF BERT directory."""
    cfg = config_with_head(cfg, model)
    return common.write_hf_dir(path, config_to_hf(cfg), to_hf_state(model, cfg))
