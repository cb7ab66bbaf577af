"""Counting a model without running it: parameters, forward FLOPs per token, KV-cache bytes.

Everything is read off a model built on the meta device (shapes only, no memory), so it works for
a 70B config on a laptop.

FLOPs convention (Kaplan et al. 2020, PaLM appendix B): a matmul of (1, n) by (n, m) is 2nm FLOPs;
per token, every Linear costs 2 * in * out, and attention over a context of T keys costs
2 * H * D * T for Q K^T plus the same for the weighted sum of V, in every layer (causal masking
is not discounted). Embedding look-ups are free; norms, softmax and activations are left out.
"""

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelStats:
    """What `inspect_config` measures. Counts are exact; FLOPs and bytes are per token."""

    total_params: int
    embedding_params: int
    block_params: list[int]
    flops_per_token: int
    context: int
    kv_bytes_per_token: dict[str, int]


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _blocks(model: nn.Module) -> list[nn.Module]:
    stacks = [m.blocks for m in model.modules() if isinstance(getattr(m, "blocks", None), nn.ModuleList)]
    return [block for stack in stacks for block in stack]


def _embedding_params(model: nn.Module) -> int:
    seen = {}
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            seen[id(m.weight)] = m.weight.numel()
    return sum(seen.values())


def flops_per_token(model: nn.Module, cfg: ModelConfig, context: int) -> int:
    """Forward FLOPs per token at `context` keys (encoder-decoder: per source+target token pair)."""
    linear = sum(2 * m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, nn.Linear))
    H, D = cfg.attention.n_heads, cfg.head_dim
    attn_layers = {"decoder": cfg.n_layers, "encoder": cfg.n_layers,
                   "encoder_decoder": cfg.n_layers + 2 * cfg.decoder_layers}[cfg.arch]
    return linear + attn_layers * 4 * H * D * context


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Bytes a decoder keeps per generated token: K and V, every layer, every kv head (0 for an
    encoder). For encoder-decoder models the cross-attention K/V cost the same per source token."""
    if cfg.arch == "encoder":
        return 0
    layers = cfg.n_layers if cfg.arch == "decoder" else cfg.decoder_layers
    return 2 * layers * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def inspect_config(cfg: ModelConfig, context: int | None = None) -> ModelStats:
    """Build `cfg` on the meta device and measure it. context: None -> cfg.max_seq_len."""
    context = cfg.max_seq_len if context is None else context
    with torch.device("meta"):
        model = build_model(cfg)
    return ModelStats(
        total_params=count_parameters(model),
        embedding_params=_embedding_params(model),
        block_params=[count_parameters(b) for b in _blocks(model)],
        flops_per_token=flops_per_token(model, cfg, context),
        context=context,
        kv_bytes_per_token={d: kv_cache_bytes_per_token(cfg, d) for d in DTYPE_BYTES},
    )


def format_stats(name: str, cfg: ModelConfig, s: ModelStats) -> str:
    """A small human-readable table."""
    blocks = sorted(set(s.block_params))
    per_block = ", ".join(f"{b:,}" for b in blocks)
    rows = [
        ("model", f"{name} ({cfg.arch}, {len(s.block_params)} blocks, d_model {cfg.d_model}, "
                  f"{cfg.attention.n_heads} heads / {cfg.n_kv_heads} kv, head_dim {cfg.head_dim})"),
        ("parameters", f"{s.total_params:,} ({s.total_params / 1e6:,.1f}M)"),
        ("  embeddings", f"{s.embedding_params:,}"),
        ("  per block", per_block),
        ("  other", f"{s.total_params - s.embedding_params - sum(s.block_params):,}"),
        (f"forward FLOPs/token @ {s.context}", f"{s.flops_per_token:,} "
                                               f"({s.flops_per_token / 1e9:,.2f} GFLOP)"),
        ("KV cache / token fp32", f"{s.kv_bytes_per_token['fp32']:,} B"),
        ("KV cache / token bf16", f"{s.kv_bytes_per_token['bf16']:,} B"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
