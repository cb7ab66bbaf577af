"""Decoder: token embedding, blocks, final norm, LM head (GPT-2 and Llama from the same code).

The same class is the decoder half of an encoder-decoder model: give its blocks cross-attention
and pass `memory` (the encoder's output) to `forward`.

What every block needs (the masks, the position scheme's cos/sin rows or score bias, the cache
slots) is computed once per forward into an `AttentionContext` and handed to each block. A model
that mixes sliding-window and global layers (Gemma 2: every other layer; Gemma 3: five local
to one global, the local ones with their own RoPE base) computes a second context for its local
layers, `ctx.local`, once per forward as well.

Shapes: B batch, T new tokens, S keys (cached + new), M memory length, C d_model, V vocab_size.
"""

from dataclasses import replace

import torch
from torch import Tensor, nn

from attnlab.components.context import AttentionContext
from attnlab.components.hooks import HookPoint
from attnlab.components.masks import (
    MaskMod,
    custom_attention_mask,
    is_mask_mod,
    mask_from_mod,
    padding_mask,
    self_attention_mask,
    uses_flex,
)
from attnlab.components.positions.base import PositionScheme
from attnlab.components.softcap import soft_cap


class DecoderLM(nn.Module):
    """A stack of causal blocks that maps token ids to next-token logits.

    Args:
        embed: TokenEmbedding (V, C).  positions: the position scheme (shared by all blocks).
        blocks: DecoderBlocks.  norm: final norm or Identity.  head: Linear(C, V), maybe tied.
        dropout: on the embeddings.  window: sliding window of self-attention, or None.
        head_scale: multiplies the final hidden state (T5 v1.0's tied head: d_model^-0.5).
        local_layers: which blocks use the window (True) and which see every earlier token;
            None: all of them use it.
        local_positions: the position scheme of the windowed blocks, or None: `positions`.
        logit_softcap: soft-cap the logits at this value (Gemma 2: 30), or None.
    """

    def __init__(
        self,
        embed: nn.Embedding,
        positions: PositionScheme,
        blocks: list[nn.Module],
        norm: nn.Module,
        head: nn.Linear,
        dropout: float = 0.0,
        window: int | None = None,
        head_scale: float = 1.0,
        local_layers: list[bool] | None = None,
        local_positions: PositionScheme | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        if local_layers is not None and len(local_layers) != len(blocks):
            raise ValueError(f"local_layers names {len(local_layers)} layers for {len(blocks)}")
        self.embed, self.positions = embed, positions
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head = norm, head
        self.drop = nn.Dropout(dropout)
        self.window, self.head_scale = window, head_scale
        self.local_layers, self.local_positions = local_layers, local_positions
        self.logit_softcap = logit_softcap
        self.hook_tokens, self.hook_embed = HookPoint(), HookPoint()  # ids, token embeddings
        self.hook_final_norm, self.hook_logits = HookPoint(), HookPoint()
        self.hook_head_in = HookPoint()  # what the head reads: the final norm's output, scaled

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        pos: Tensor | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache=None,
        slots: Tensor | None = None,
        last_only: bool = False,
        attn_mask: Tensor | MaskMod | None = None,
    ) -> Tensor:
        """Next-token logits.

        Args:
            ids: (B, T) token ids.
            attention_mask: (B, T) True = real token; None = no padding. (With a cache, padding
                is the cache's `key_valid`.)
            pos: (T,) or (B, T) absolute positions of `ids`; default 0..T-1 (with a cache: the
                cache's positions of `slots`).
            memory: (B, M, C) encoder output, for blocks with cross-attention.
            memory_mask: (B, M) True = real memory token.
            cache: a StepCache: a ModelCache (components/kv_cache.py) or a PagedStep
                (components/paged_kv_cache.py), or None. It gives the rows' positions and the
                mask (`positions_and_mask`); each layer attends through its own `LayerCache`.
            slots: (T,) cache slots of `ids`, with a ModelCache; (B, T) per-row pool slots
                (the step's `.slots`), with a PagedStep.
            last_only: the logits of the last position only (generation's prefill needs no
                more, and the head is the largest matmul: GPT-2's is 768 x 50257).
            attn_mask: bool (T, T) or (B, T, T), True = query i may attend to key j: replaces
                the causal (and sliding-window) mask, e.g. a prefix-LM or permutation mask
                (components/masks.py); combined with `attention_mask`. Not with a cache.
                Or a mask_mod (b, h, i, j) -> bool (e.g. `document_mask_mod` for packed
                sequences), the same for every head: built once per forward into a BlockMask
                when every layer uses backend "flex", else evaluated into a (B, T, T) mask.

        Returns:
            (B, T, V) logits, or (B, 1, V) with last_only.
        """
        ctx, pos = self.context(
            ids, attention_mask, pos, memory, memory_mask, cache, slots, attn_mask
        )
        x = self.hook_embed(self.embed(self.hook_tokens(ids)))  # (B, T, C)
        x = self.drop(self.positions.embed(x, pos))  # (B, T, C)
        x = self.run_blocks(x, ctx, cache)  # (B, T, C)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.logits(x)  # (B, T, V)

    def context(
        self,
        ids: Tensor,
        attention_mask: Tensor | None,
        pos: Tensor | None,
        memory: Tensor | None,
        memory_mask: Tensor | None,
        cache,
        slots: Tensor | None,
        attn_mask: Tensor | MaskMod | None = None,
    ) -> tuple[AttentionContext, Tensor]:
        """What every block needs, computed once per forward (arguments as `forward`).

        Returns:
            (ctx, pos): the AttentionContext (with `ctx.local` for the windowed layers of a
            model that mixes them with global ones), and the positions of `ids`, (T,) or (B, T).
        """
        args = (ids, attention_mask, pos, memory, memory_mask, cache, slots, attn_mask)
        if self.local_layers is None:
            return self._context(*args, self.window, self.positions)
        ctx, pos = self._context(*args, None, self.positions)
        local_positions = self.positions if self.local_positions is None else self.local_positions
        local, _ = self._context(*args, self.window, local_positions)
        return replace(ctx, local=local), pos

    def _context(
        self,
        ids: Tensor,
        attention_mask: Tensor | None,
        pos: Tensor | None,
        memory: Tensor | None,
        memory_mask: Tensor | None,
        cache,
        slots: Tensor | None,
        attn_mask: Tensor | MaskMod | None,
        window: int | None,
        positions: PositionScheme,
    ) -> tuple[AttentionContext, Tensor]:
        """One AttentionContext, for layers with this `window` and position scheme."""
        B, T = ids.shape
        if attn_mask is not None and cache is not None:
            raise ValueError("attn_mask cannot be used with a KV cache; pass cache=None")
        if cache is None:
            bound = T if pos is None else None  # default positions: all below T, known from shape
            pos = torch.arange(T, device=ids.device) if pos is None else pos
            k_pos = pos
            if attn_mask is None:
                mask, is_causal = self_attention_mask(T, T, attention_mask, window, ids.device)
            elif is_mask_mod(attn_mask):
                flex = uses_flex(self)
                mask = mask_from_mod(attn_mask, B, T, attention_mask, flex, ids.device)
                is_causal = False
            else:
                mask, is_causal = custom_attention_mask(attn_mask, B, T, attention_mask), False
        else:  # the cache knows its rows' positions and what each new token may see
            pos, k_pos, bound, mask = cache.positions_and_mask(slots, window)
            is_causal = False
        ctx = AttentionContext(
            mask=mask,
            is_causal=is_causal,
            positions=positions.prepare(pos, k_pos, bound),
            slots=slots,
            memory=memory,
            memory_mask=None if memory_mask is None else padding_mask(memory_mask),  # (B,1,1,M)
        )
        return ctx, pos

    def run_blocks(self, x: Tensor, ctx: AttentionContext, cache=None) -> Tensor:
        """Every block in turn on x (B, T, C), each with its own layer of the cache."""
        for i, block in enumerate(self.blocks):
            layer = None if cache is None else cache.layers[i]
            cross = None if cache is None or cache.cross is None else cache.cross[i]
            local = ctx.local is not None and self.local_layers[i]
            x = block(x, ctx.local if local else ctx, layer, cross)  # (B, T, C)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """Final norm and LM head: hidden states (B, T, C) -> logits (B, T, V)."""
        x = self.hook_final_norm(self.norm(x))  # (B, T, C)
        if self.head_scale != 1.0:
            x = x * self.head_scale
        logits = self.head(self.hook_head_in(x))  # (B, T, V)
        if self.logit_softcap is not None:
            logits = soft_cap(logits, self.logit_softcap)
        return self.hook_logits(logits)
