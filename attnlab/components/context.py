"""What every layer of one forward needs, computed once by the model and handed to each block.

    model.forward                                   each block / attention layer
    ─────────────                                   ────────────────────────────
    positions.prepare(q_pos, k_pos) ─┐
    self-attention mask / is_causal ─┼─> AttentionContext ─> block(x, ctx, cache=...)
    cross mask, memory, cache slots ─┘

Nothing in it depends on the layer, so computing it per layer (the RoPE gather, the ALiBi or T5
bias, the masks) would repeat the same work L times; gpt-fast builds `freqs_cis` and the mask once
in `Transformer.forward` for the same reason. A layer reads the fields, applies
`ctx.positions.rotate_qk` and adds `ctx.positions.bias`, and never asks which scheme made them.

Shapes: B batch, H heads, T new tokens, S keys (cached + new), M memory length, C d_model.
"""

from dataclasses import dataclass, field

from torch import Tensor

from attnlab.components.positions.base import NO_TERMS, PositionTerms


@dataclass(frozen=True)
class AttentionContext:
    """One forward's masks, position terms, cache slots and encoder memory.

    Attributes:
        mask: self-attention, bool broadcastable to (B, H, T, S), True = may attend; or None.
        is_causal: add a causal mask (cheaper than passing one: SDPA's flash path).
        positions: the position scheme's prepared terms (RoPE cos/sin, or a score bias).
        slots: (T,) cache slots of the new tokens, when a cache is written; (B, T) per-row pool
            slots with a paged cache (components/paged_kv_cache.py).
        memory: (B, M, C_kv) encoder output, for cross-attention.
        memory_mask: cross-attention, bool broadcastable to (B, H, T, M); or None.
        local: the context of the sliding-window layers when a model mixes them with global
            ones (Gemma 2 and 3): their own window mask and, where their RoPE base differs,
            their own position terms; None when every layer reads this one.
    """

    mask: Tensor | None = None
    is_causal: bool = False
    positions: PositionTerms = field(default=NO_TERMS)
    slots: Tensor | None = None
    memory: Tensor | None = None
    memory_mask: Tensor | None = None
    local: "AttentionContext | None" = None


NO_CONTEXT = AttentionContext()  # no mask, no positions: a bidirectional layer on its own
