"""BERT (HF `BertForMaskedLM`, `BertForSequenceClassification`) <-> attnlab encoder models.

    BertForMaskedLM                -> EncoderForMLM             (cls.predictions.* -> head.*)
    BertForSequenceClassification  -> EncoderForClassification  (bert.pooler, classifier)

BERT is post-norm: each sublayer's LayerNorm (`attention.output.LayerNorm`, `output.LayerNorm`)
comes after its residual sum, which is our Residual with placement "post". The LayerNorm BERT
applies to the summed word + position + segment embeddings is our `encoder.embed_norm`.
The MLM decoder is tied to the word embeddings; its bias is `cls.predictions.bias`.

Config: huggingface.co/google-bert/bert-base-uncased/config.json.
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.interop.hf import common
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.encoder import EncoderForClassification

ARCHITECTURES = {"BertForMaskedLM": "mlm", "BertForSequenceClassification": "classifier"}

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
CLASSIFIER: common.KeyTable = [
    ("pooler.weight", "bert.pooler.dense.weight"),
    ("pooler.bias", "bert.pooler.dense.bias"),
    ("classifier.weight", "classifier.weight"),
    ("classifier.bias", "classifier.bias"),
]
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


def n_labels_from_hf(hf: dict) -> int:
    if "id2label" in hf:
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


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
    if cfg.type_vocab_size < 1:
        raise ValueError(
            "an HF BERT checkpoint cannot hold this config: type_vocab_size=0 "
            "(BERT always has segment embeddings; needs >= 1)"
        )


def config_to_hf(cfg: ModelConfig, n_labels: int | None = None) -> dict:
    """ModelConfig -> an HF BERT config.json dict (a classifier when n_labels is given)."""
    check_config(cfg)
    hf = {
        "architectures": [
            "BertForMaskedLM" if n_labels is None else "BertForSequenceClassification"
        ],
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
    if n_labels is not None:
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(n_labels)}
        hf["label2id"] = {f"LABEL_{i}": i for i in range(n_labels)}
    return hf


def _table(cfg: ModelConfig, classifier: bool) -> dict[str, str]:
    if classifier:
        head = CLASSIFIER
    else:
        head = MLM_HEAD + ([] if cfg.tie_embeddings else MLM_DECODER)
    return common.expand(ENCODER + head, cfg.n_layers)


def to_hf_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> HF BERT names (also run on a meta model for the expected keys)."""
    table = _table(cfg, isinstance(model, EncoderForClassification))
    state = common.drop_tied_aliases(model, common.model_state(model), table)
    return common.rename(state, table, what="attnlab BERT model")


def _from_hf_state(classifier: bool):
    def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """HF BERT tensors -> our names."""
        inverse = {hf_name: ours for ours, hf_name in _table(cfg, classifier).items()}
        return common.rename(state, inverse)

    return from_hf_state


def load_hf(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """An HF BERT directory -> (EncoderForMLM or EncoderForClassification in eval mode, config)."""
    if layout != "half":
        raise ValueError(f"BERT has no RoPE; layout={layout!r} does not apply")
    hf, state = common.read_config(path), common.read_state_dict(path)
    arch = (hf.get("architectures") or ["BertForMaskedLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"BERT architecture {arch!r} is not supported; choose from {sorted(ARCHITECTURES)}"
        )
    classifier = ARCHITECTURES[arch] == "classifier"
    cfg = config_from_hf(hf)
    if not classifier:
        cfg, state = common.resolve_tie(
            cfg, state, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
        )
    ignore = [
        k for k in state if k in IGNORED or (not classifier and k.startswith(IGNORED_MLM_PREFIXES))
    ]
    model = common.load_checked(
        cfg,
        state,
        to_hf_state,
        _from_hf_state(classifier),
        ignore,
        what=f"BERT checkpoint {str(path)!r}",
        n_labels=n_labels_from_hf(hf) if classifier else None,
        dtype=dtype,
    )
    return model, cfg


def save_hf(model: nn.Module, cfg: ModelConfig, path: str | Path) -> Path:
    """Write an EncoderForMLM or EncoderForClassification as an HF BERT directory."""
    classifier = isinstance(model, EncoderForClassification)
    hf = config_to_hf(cfg, model.classifier.out_features if classifier else None)
    return common.write_hf_dir(path, hf, to_hf_state(model, cfg))
