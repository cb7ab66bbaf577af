"""The one place that turns a ModelConfig's names into modules.

Components never see a ModelConfig: this module reads the config, looks each variant up in its
component's small registry, and passes built submodules into blocks and models.
"""

from dataclasses import replace

import torch
from torch import nn

from attnlab.components.attention import Attention
from attnlab.components.blocks import DecoderBlock, EncoderBlock
from attnlab.components.embedding import TokenEmbedding, tie_weights
from attnlab.components.ffn import ACTIVATIONS, MLP, GatedMLP
from attnlab.components.init import init_weights
from attnlab.components.mla import MultiHeadLatentAttention
from attnlab.components.moe import MoE
from attnlab.components.norms import build_norm
from attnlab.components.positions import (
    ALiBi,
    DynamicNTKRoPE,
    LearnedPosition,
    NoPosition,
    PositionScheme,
    RoPE,
    SinusoidalPosition,
    T5Bias,
)
from attnlab.components.vision import PatchEmbedding
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import Encoder, EncoderForClassification, EncoderForMLM, MLMHead
from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.models.heads import (
    DecoderForSequenceClassification,
    EncoderForMeanPooledClassification,
    EncoderForTokenClassification,
)
from attnlab.models.vision import PrefixVisionLM, VisionEncoder, VisionEncoderDecoder


def build_positions(cfg: ModelConfig, causal: bool, local: bool = False) -> PositionScheme:
    """The position scheme of one stack (T5's bias is causal in the decoder, bidirectional else);
    `local`: RoPE with base rope.local_theta and no scaling, for the windowed layers (Gemma 3)."""
    a = cfg.attention
    theta, scaling = (cfg.rope.local_theta, None) if local else (cfg.rope.theta, cfg.rope.scaling)
    builders = {
        "none": lambda: NoPosition(),
        "sinusoidal": lambda: SinusoidalPosition(cfg.d_model, cfg.max_seq_len),
        "learned": lambda: LearnedPosition(cfg.max_seq_len, cfg.d_model),
        "rope": lambda: _rope_class(scaling)(
            cfg.rope_head_dim,
            cfg.max_seq_len,
            theta,
            cfg.rope.layout,
            cfg.rope.partial_rotary,
            scaling,
        ),
        "alibi": lambda: ALiBi(a.n_heads),
        "t5_bias": lambda: T5Bias(
            a.n_heads, cfg.t5_num_buckets, cfg.t5_max_distance, bidirectional=not causal
        ),
    }
    # Position tables are computed, not learned: build them on the CPU even inside a meta-device
    # build, so a model whose weights are assigned later has nothing left to recompute.
    with torch.device("cpu"):
        scheme = builders[cfg.position]()
    if a.backend == "flex":
        scheme.bias_form = "score_mod"  # the flex backend reads a bias as a function, not (H, T, S)
    elif a.backend == "auto":
        scheme.bias_form = "auto"  # a function for long query blocks (then flex), else a tensor
    return scheme


def _rope_class(scaling) -> type[RoPE]:
    """Dynamic NTK recomputes its frequencies per length, so it is its own class."""
    return DynamicNTKRoPE if scaling is not None and scaling.kind == "dynamic" else RoPE


def build_attention(cfg: ModelConfig, cross: bool = False) -> nn.Module:
    """An Attention (kind "standard"), or a MultiHeadLatentAttention (kind "mla")."""
    a = cfg.attention
    if a.kind == "mla":
        return MultiHeadLatentAttention(
            cfg.d_model,
            a.n_heads,
            a.kv_lora_rank,
            a.qk_rope_head_dim,
            a.qk_nope_head_dim,
            a.v_head_dim,
            a.q_lora_rank,
            out_bias=a.out_bias,
            dropout=cfg.dropout,
            scale=a.softmax_scale,
            backend=a.backend,
            norm_eps=cfg.norm_eps,
        )
    return Attention(
        cfg.d_model,
        a.n_heads,
        a.n_kv_heads,
        a.head_dim,
        qkv_bias=a.qkv_bias,
        out_bias=a.out_bias,
        qk_norm=a.qk_norm,
        dropout=cfg.dropout,
        scale=a.softmax_scale,
        backend=a.backend,
        cross=cross,
        norm_eps=cfg.norm_eps,
        qk_norm_scope=a.qk_norm_scope,
        norm_unit_offset=cfg.norm_unit_offset,
        softcap=a.logit_softcap,
    )


def build_ffn(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """The FFN of block `layer`: an MoE when cfg.moe says so (past its first dense layers)."""
    if cfg.moe is not None and layer >= cfg.moe.first_dense_layers:
        return build_moe(cfg)
    if cfg.ffn == "mlp":
        return MLP(cfg.d_model, cfg.ffn_width, cfg.activation, cfg.ffn_bias, cfg.dropout)
    gate = "silu" if cfg.ffn == "swiglu" else cfg.activation
    return GatedMLP(cfg.d_model, cfg.ffn_width, gate, cfg.ffn_bias, cfg.dropout)


def build_moe(cfg: ModelConfig) -> MoE:
    m = cfg.moe
    return MoE(
        cfg.d_model,
        cfg.expert_width,
        m.n_experts,
        m.n_experts_per_token,
        m.score,
        m.normalize,
        m.n_groups,
        m.topk_groups,
        m.routed_scale,
        m.d_shared,
        m.shared_gate,
        m.bias_update_rate,
        dropout=cfg.dropout,
    )


def build_norm_for(cfg: ModelConfig) -> nn.Module:
    return build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_unit_offset)


def build_block_norms(cfg: ModelConfig, n: int) -> tuple[list[nn.Module], list | None, str]:
    """The n sublayers' input norms, output norms (or None) and the Residual placement:
    "sandwich" has both norms, "post_sublayer" an Identity in place of the input norm."""
    placement = cfg.norm_placement
    if placement in ("pre", "post"):
        return [build_norm_for(cfg) for _ in range(n)], None, placement
    outs = [build_norm_for(cfg) for _ in range(n)]
    ins = [build_norm_for(cfg) if placement == "sandwich" else nn.Identity() for _ in range(n)]
    return ins, outs, "pre"


def build_block(cfg: ModelConfig, causal: bool, cross: bool = False, layer: int = 0) -> nn.Module:
    """An EncoderBlock (causal=False) or a DecoderBlock, with cross-attention if `cross`;
    `layer` is its index in the stack (which FFN it gets, see build_ffn)."""
    norms, outs, placement = build_block_norms(cfg, 3 if cross else 2)
    if not causal:
        return EncoderBlock(
            build_attention(cfg), build_ffn(cfg), norms, placement, cfg.dropout, outs
        )
    cross_attn = build_attention(cfg, cross=True) if cross else None
    ffn = build_ffn(cfg, layer)
    return DecoderBlock(build_attention(cfg), ffn, norms, cross_attn, placement, cfg.dropout, outs)


def _final_norm(cfg: ModelConfig) -> nn.Module:
    return build_norm_for(cfg) if cfg.has_final_norm else nn.Identity()


def build_encoder(cfg: ModelConfig, embed: TokenEmbedding) -> Encoder:
    blocks = [build_block(cfg, causal=False) for _ in range(cfg.n_layers)]
    types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
    embed_norm = build_norm_for(cfg) if cfg.embed_norm else None
    return Encoder(
        embed,
        build_positions(cfg, causal=False),
        blocks,
        _final_norm(cfg),
        types,
        embed_norm,
        cfg.dropout,
    )


def build_decoder(cfg: ModelConfig, embed: TokenEmbedding, n_layers: int, cross: bool) -> DecoderLM:
    blocks = [build_block(cfg, causal=True, cross=cross, layer=i) for i in range(n_layers)]
    head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    if cfg.tie_embeddings:
        tie_weights(head, embed)
    head_scale = cfg.d_model**-0.5 if cfg.head_rescale else 1.0
    local, local_positions = _layer_pattern(cfg, n_layers)
    return DecoderLM(
        embed,
        build_positions(cfg, causal=True),
        blocks,
        _final_norm(cfg),
        head,
        cfg.dropout,
        cfg.attention.sliding_window,
        head_scale,
        local,
        local_positions,
        cfg.logit_softcap,
    )


def _layer_pattern(
    cfg: ModelConfig, n_layers: int
) -> tuple[list[bool] | None, PositionScheme | None]:
    """Which of n_layers decoder layers use the window (None: all), and the position scheme of
    the windowed ones where their RoPE base differs (None: the same as the others)."""
    a = cfg.attention
    local = [a.is_local(i) for i in range(n_layers)] if a.global_every is not None else None
    local_positions = None if cfg.rope.local_theta is None else build_positions(cfg, True, True)
    return local, local_positions


def build_decoder_classifier(cfg: ModelConfig, embed: TokenEmbedding) -> nn.Module:
    """A decoder whose head maps the last real token to cfg.head.num_labels logits."""
    blocks = [build_block(cfg, causal=True) for _ in range(cfg.n_layers)]
    score = nn.Linear(cfg.d_model, cfg.head.num_labels, bias=False)  # never tied
    return DecoderForSequenceClassification(
        embed,
        build_positions(cfg, causal=True),
        blocks,
        _final_norm(cfg),
        score,
        cfg.dropout,
        cfg.attention.sliding_window,
        cfg.d_model**-0.5 if cfg.head_rescale else 1.0,
        *_layer_pattern(cfg, cfg.n_layers),
        pad_token_id=cfg.head.pad_token_id,
    )


def build_encoder_head(cfg: ModelConfig, embed: TokenEmbedding) -> nn.Module:
    """An encoder with the sequence or token classifier of cfg.head."""
    if cfg.head.task == "token":
        cls = EncoderForTokenClassification
    elif cfg.head.pooling == "mean":
        cls = EncoderForMeanPooledClassification
    else:
        cls = EncoderForClassification
    return cls(build_encoder(cfg, embed), cfg.d_model, cfg.head.num_labels, cfg.dropout)


def build_vision_encoder(cfg: ModelConfig) -> VisionEncoder:
    """A ViT with the text model's width, attention, norm and FFN settings (cfg.vision set)."""
    v = cfg.vision
    patches = PatchEmbedding(
        v.image_size, v.patch_size, v.in_channels, cfg.d_model, v.patchify, v.position, v.cls_token
    )
    blocks = [build_block(cfg, causal=False) for _ in range(v.n_layers)]
    norm = _final_norm(cfg) if v.n_layers else nn.Identity()
    return VisionEncoder(patches, blocks, norm, cfg.dropout)


def build_vlm(cfg: ModelConfig, embed: TokenEmbedding) -> nn.Module:
    """A vision-language model: the ViT joined to the decoder as cfg.vision.connect says."""
    if cfg.vision.connect == "cross_attention":
        return VisionEncoderDecoder(
            build_vision_encoder(cfg), build_decoder(cfg, embed, cfg.n_layers, cross=True)
        )
    projector = nn.Linear(cfg.d_model, cfg.d_model)
    return PrefixVisionLM(
        build_vision_encoder(cfg), projector, build_decoder(cfg, embed, cfg.n_layers, cross=False)
    )


def build_model(cfg: ModelConfig, n_labels: int | None = None) -> nn.Module:
    """Build the model a config describes, initialised with its init scheme.

    Args:
        cfg: the model config; with `head` set, the task head's model (models/heads.py).
        n_labels: shorthand for cfg.head = HeadConfig("sequence", n_labels) on an encoder
            without a head.

    Returns:
        DecoderLM ("decoder"), EncoderForMLM ("encoder"), EncoderDecoder ("encoder_decoder"),
        VisionEncoderDecoder / PrefixVisionLM ("vlm"); with a head, EncoderForClassification,
        EncoderForTokenClassification or DecoderForSequenceClassification.
    """
    if n_labels is not None:
        if cfg.arch != "encoder" or cfg.head is not None:
            raise ValueError(
                f"n_labels={n_labels} builds a classifier, which needs arch='encoder' without "
                f"a head, not arch={cfg.arch!r} with head={cfg.head}"
            )
        if n_labels < 1:
            raise ValueError(f"n_labels must be >= 1, got {n_labels}")
        cfg = replace(cfg, head=HeadConfig("sequence", n_labels))
    # A decoder's embed_norm normalises the token vectors (BLOOM); an encoder's normalises the sum
    # of token, position and segment embeddings (BERT), so the Encoder applies it itself.
    embed_norm = build_norm_for(cfg) if cfg.embed_norm and cfg.arch == "decoder" else None
    embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.scale_embeddings, embed_norm)
    if cfg.head is not None:
        build = build_encoder_head if cfg.arch == "encoder" else build_decoder_classifier
        model = build(cfg, embed)
    elif cfg.arch == "decoder":
        model = build_decoder(cfg, embed, cfg.n_layers, cross=False)
    elif cfg.arch == "encoder_decoder":
        model = EncoderDecoder(
            build_encoder(cfg, embed), build_decoder(cfg, embed, cfg.decoder_layers, cross=True)
        )
    elif cfg.arch == "vlm":
        model = build_vlm(cfg, embed)
    else:
        act = ACTIVATIONS[cfg.activation]
        head = MLMHead(cfg.d_model, cfg.vocab_size, build_norm_for(cfg), act)
        if cfg.tie_embeddings:
            tie_weights(head.decoder, embed)
        model = EncoderForMLM(build_encoder(cfg, embed), head)
    init_weights(model, cfg.init, cfg.n_layers, cfg.init_std)
    return model
