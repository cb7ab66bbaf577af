"""Counting a model without running it: parameters, forward FLOPs per token, KV-cache bytes.

Everything is read off a model built on the meta device (shapes only, no memory), so it works for
a 70B config on a laptop.

FLOPs convention (Kaplan et al. 2020, PaLM appendix B): a matmul of (1, n) by (n, m) is 2nm FLOPs;
per token, every Linear costs 2 * in * out, and attention over a context of T keys costs
2 * H * D * T for Q K^T plus the same for the weighted sum of V, in every layer (causal masking
is not discounted; a sliding-window layer sees min(T, window) keys: Mistral, Gemma's local
layers). Embedding look-ups are free; norms, softmax and activations are left out.
MLA's scores are counted in its plain form (what training runs): 2 * H * (Dn + R) * T for the
scores and 2 * H * Dv * T for the values.

A Mixture-of-Experts layer (components/moe.py) runs k of its E experts per token: its FLOPs are
the router's, the shared experts' and k experts' (the "active" compute); "active parameters" are
likewise every parameter but the E - k experts a token does not use.

KV cache per token and layer: 2 * K * D numbers for MHA/GQA/MQA; for MLA only the latent and the
shared rope key, r + R (DeepSeek-V2 §2.1.4: 576 numbers where its MHA would keep 2 * 128 * 128).
"""

from dataclasses import dataclass, replace

import torch
from torch import nn

from attnlab.components.moe import moe_layers
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelStats:
    """What `inspect_config` measures. Counts are exact; FLOPs and bytes are per token."""

    total_params: int
    active_params: int  # what one token uses: total_params without the experts it skips
    embedding_params: int
    block_params: list[int]
    flops_per_token: int
    context: int
    kv_bytes_per_token: dict[str, int]


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _blocks(model: nn.Module) -> list[nn.Module]:
    stacks = [
        m.blocks for m in model.modules() if isinstance(getattr(m, "blocks", None), nn.ModuleList)
    ]
    return [block for stack in stacks for block in stack]


def _embedding_params(model: nn.Module) -> int:
    seen = {}
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            seen[id(m.weight)] = m.weight.numel()
    return sum(seen.values())


def _linear_flops(module: nn.Module) -> int:
    return sum(
        2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear)
    )


def _skipped_experts(model: nn.Module, measure) -> int:
    """`measure` of the routed experts each token skips: (E - k) experts in every MoE layer."""
    return sum((m.n_experts - m.k) * measure(m.experts[0]) for m in moe_layers(model))


def active_parameters(model: nn.Module) -> int:
    """The parameters one token's forward uses (all of them in a dense model)."""
    return count_parameters(model) - _skipped_experts(model, count_parameters)


def flops_per_token(model: nn.Module, cfg: ModelConfig, context: int) -> int:
    """Forward FLOPs per token at `context` keys (encoder-decoder: per source+target token pair);
    an MoE layer counts the k experts a token uses."""
    linear = _linear_flops(model) - _skipped_experts(model, _linear_flops)
    H = cfg.attention.n_heads
    qk_dim, v_dim = _score_widths(cfg)
    if cfg.arch == "decoder":  # the keys each layer sees, summed over the layers
        keys = sum(_keys_seen(cfg, i, context) for i in range(cfg.n_layers))
    else:
        attn_layers = cfg.n_layers + (
            2 * cfg.decoder_layers if cfg.arch == "encoder_decoder" else 0
        )
        keys = attn_layers * context
    return linear + 2 * H * (qk_dim + v_dim) * keys


def _keys_seen(cfg: ModelConfig, layer: int, context: int) -> int:
    """How many keys a decoder layer's query attends to at `context`: a windowed layer no more
    than its window."""
    a = cfg.attention
    return min(context, a.sliding_window) if a.is_local(layer) else context


def _score_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Per-head widths of (queries . keys, values): (D, D), or MLA's (Dn + R, Dv)."""
    a = cfg.attention
    if a.kind == "mla":
        return a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    return cfg.head_dim, cfg.head_dim


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Bytes a decoder keeps per generated token: K and V, every layer, every kv head (0 for an
    encoder). For encoder-decoder models the cross-attention K/V cost the same per source token.
    MLA keeps (kv_lora_rank + qk_rope_head_dim) numbers per layer: the latent and the rope key."""
    if cfg.arch == "encoder":
        return 0
    layers = cfg.n_layers if cfg.arch == "decoder" else cfg.decoder_layers
    a = cfg.attention
    if a.kind == "mla":
        return layers * (a.kv_lora_rank + a.qk_rope_head_dim) * DTYPE_BYTES[dtype]
    return 2 * layers * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def inspect_config(cfg: ModelConfig, context: int | None = None) -> ModelStats:
    """Build `cfg` on the meta device and measure it. context: None -> cfg.max_seq_len."""
    context = cfg.max_seq_len if context is None else context
    with torch.device("meta"):
        model = build_model(cfg)
    return ModelStats(
        total_params=count_parameters(model),
        active_params=active_parameters(model),
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
        (
            "model",
            f"{name} ({cfg.arch}, {len(s.block_params)} blocks, d_model {cfg.d_model}, "
            f"{_attention_summary(cfg)})",
        ),
        ("parameters", f"{s.total_params:,} ({s.total_params / 1e6:,.1f}M)"),
        *_active_row(cfg, s),
        ("  embeddings", f"{s.embedding_params:,}"),
        ("  per block", per_block),
        ("  other", f"{s.total_params - s.embedding_params - sum(s.block_params):,}"),
        (
            f"forward FLOPs/token @ {s.context}",
            f"{s.flops_per_token:,} ({s.flops_per_token / 1e9:,.2f} GFLOP)",
        ),
        ("KV cache / token fp32", f"{s.kv_bytes_per_token['fp32']:,} B"),
        ("KV cache / token bf16", f"{s.kv_bytes_per_token['bf16']:,} B"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _active_row(cfg: ModelConfig, s: ModelStats) -> list[tuple[str, str]]:
    """The active-parameter row of an MoE model (none for a dense one)."""
    m = cfg.moe
    if m is None:
        return []
    what = f"{m.n_experts_per_token} of {m.n_experts} experts" + (" + shared" if m.d_shared else "")
    share = 100 * s.active_params / s.total_params
    return [("  active / token", f"{s.active_params:,} ({share:.0f}%: {what})")]


def _attention_summary(cfg: ModelConfig) -> str:
    a = cfg.attention
    if a.kind == "mla":
        q = "" if a.q_lora_rank is None else f", q latent {a.q_lora_rank}"
        return (
            f"{a.n_heads} heads MLA: kv latent {a.kv_lora_rank} + rope key "
            f"{a.qk_rope_head_dim}{q}, qk {a.qk_nope_head_dim}+{a.qk_rope_head_dim}, "
            f"v {a.v_head_dim}"
        )
    return f"{a.n_heads} heads / {cfg.n_kv_heads} kv, head_dim {cfg.head_dim}"


# --- KV-cache variants and the FLOPs split (what `attnlab inspect` tables and --plot draw) ---
@dataclass(frozen=True)
class KVVariant:
    """The KV cache of one variant of a config at batch x context (bytes for each dtype)."""

    name: str  # "MHA", "GQA", "MQA" or "MLA"
    n_kv_heads: int  # MLA: 1, its one latent "head" (absorbed MLA is MQA on the latent)
    cache_bytes: dict[str, int]
    total_params: int
    is_config: bool  # the config's own n_kv_heads


def _gqa_heads(n_heads: int, n_kv_heads: int) -> int | None:
    """The config's K when it is GQA; else the divisor of H nearest H / 4 (Llama 3: 32 / 8)."""
    if 1 < n_kv_heads < n_heads:
        return n_kv_heads
    divisors = [k for k in range(2, n_heads) if n_heads % k == 0]
    return min(divisors, key=lambda k: (abs(k - n_heads / 4), k)) if divisors else None


def kv_variants(cfg: ModelConfig) -> dict[str, ModelConfig]:
    """The same config with n_kv_heads = H (MHA), a GQA K, and 1 (MQA); GQA is left out when
    H has no divisor strictly between 1 and H. An MLA config comes first, as "MLA", and its
    standard variants use head_dim = qk_nope_head_dim (DeepSeek-V2's d_h, as in its comparison)."""
    H, a = cfg.attention.n_heads, cfg.attention
    variants, base = {}, a
    if a.kind == "mla":
        variants["MLA"] = cfg
        base = replace(
            a,
            kind="standard",
            kv_lora_rank=None,
            q_lora_rank=None,
            qk_rope_head_dim=None,
            qk_nope_head_dim=None,
            v_head_dim=None,
            head_dim=a.qk_nope_head_dim,
        )
    heads = {"MHA": H, "GQA": _gqa_heads(H, cfg.n_kv_heads), "MQA": 1}
    return variants | {
        name: replace(cfg, attention=replace(base, n_kv_heads=k))
        for name, k in heads.items()
        if k is not None and not (name == "MQA" and H == 1)
    }


def kv_cache_table(cfg: ModelConfig, batch: int, context: int) -> list[KVVariant]:
    """KV-cache bytes of batch x context tokens for the MHA / GQA / MQA variants of `cfg`."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got batch={batch}, context={context}")
    rows = []
    for name, variant in kv_variants(cfg).items():
        with torch.device("meta"):
            params = count_parameters(build_model(variant))
        per_token = {d: kv_cache_bytes_per_token(variant, d) for d in DTYPE_BYTES}
        mla = variant.attention.kind == "mla"
        rows.append(
            KVVariant(
                name,
                1 if mla else variant.n_kv_heads,
                {d: b * batch * context for d, b in per_token.items()},
                params,
                variant.attention.kind == cfg.attention.kind
                and variant.n_kv_heads == cfg.n_kv_heads,
            )
        )
    return rows


def flops_split(cfg: ModelConfig, context: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token split by where they go; the parts sum to `flops_per_token`.

    Returns:
        {"attention projections": q/k/v/o Linears (MLA: its down/up projections too),
        "attention scores": Q K^T and P V (4 H D context per attention layer),
        "ffn": the feed-forward Linears (an MoE's router, shared and k routed experts),
        "head and other": everything else (LM head, pooler, MLM head)}.
    """
    from attnlab.components.attention import Attention
    from attnlab.components.ffn import MLP, GatedMLP
    from attnlab.components.mla import MultiHeadLatentAttention

    context = cfg.max_seq_len if context is None else context
    with torch.device("meta"):
        model = build_model(cfg)

    def linear_flops(modules) -> int:
        return sum(
            2 * m.in_features * m.out_features
            for p in modules
            for m in p.modules()
            if isinstance(m, nn.Linear)
        )

    attention = Attention | MultiHeadLatentAttention
    attn = linear_flops(m for m in model.modules() if isinstance(m, attention))
    moes = moe_layers(model)
    inside = {id(m) for moe in moes for m in moe.modules()}  # experts counted with their MoE
    dense = [m for m in model.modules() if isinstance(m, MLP | GatedMLP) and id(m) not in inside]
    skipped = _skipped_experts(model, _linear_flops)  # the E - k experts a token does not run
    ffn = linear_flops(dense + moes) - skipped
    total = flops_per_token(model, cfg, context)
    scores = total - (linear_flops([model]) - skipped)
    return {
        "attention projections": attn,
        "attention scores": scores,
        "ffn": ffn,
        "head and other": total - attn - scores - ffn,
    }


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def format_costs(cfg: ModelConfig, batch: int, context: int) -> str:
    """KV cache of MHA / GQA / MQA at batch x context, and the FLOPs split, as two small tables."""
    lines = []
    if cfg.arch == "encoder":
        lines.append("KV cache: none (an encoder keeps no cache)")
    else:
        note = " (self-attention; cross K/V add as much per source token)"
        lines.append(
            f"KV cache @ batch {batch} x context {context}"
            + (note if cfg.arch == "encoder_decoder" else "")
        )
        lines.append(f"  {'variant':<8} {'kv heads':>8} {'bf16':>12} {'fp32':>12} {'params':>16}")
        for r in kv_cache_table(cfg, batch, context):
            mark = "  <- this config" if r.is_config else ""
            lines.append(
                f"  {r.name:<8} {r.n_kv_heads:>8} {_human_bytes(r.cache_bytes['bf16']):>12} "
                f"{_human_bytes(r.cache_bytes['fp32']):>12} {r.total_params:>16,}{mark}"
            )
    split = flops_split(cfg, context)
    total = sum(split.values())
    lines.append(f"forward FLOPs/token @ {context}, split")
    for part, flops in split.items():
        lines.append(f"  {part:<22} {flops:>18,} {100 * flops / total:>6.1f}%")
    return "\n".join(lines)
