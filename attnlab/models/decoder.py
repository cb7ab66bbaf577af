"""Decoder: token embedding, blocks, final norm, LM head (GPT-2 and Llama from the same code).

The same class is the decoder half of an encoder-decoder model: give its blocks cross-attention
and pass `memory` (the encoder's output) to `forward`.

What every block needs (the masks, the position scheme's cos/sin rows or score bias, the cache
slots) is computed once per forward into an `AttentionContext` and handed to each block.

Shapes: B batch, T new tokens, S keys (cached + new), M memory length, C d_model, V vocab_size.
"""

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from attnlab.components.context import AttentionContext
from attnlab.components.flex import block_mask
from attnlab.components.masks import MaskMod, causal_mask, padding_mask, sliding_window_mask
from attnlab.components.positions.base import PositionScheme


def self_attention_mask(
    T: int, S: int, attention_mask: Tensor | None, window: int | None, device
) -> tuple[Tensor | None, bool]:
    """The causal self-attention mask of a decoder, and whether SDPA may use is_causal instead.

    Args:
        T: new query tokens.  S: key positions (cached + new); queries are the last T of them.
        attention_mask: (B, S) True = real token, or None (no padding).
        window: sliding window, or None.

    Returns:
        (mask, is_causal): mask bool (T, S) or (B, 1, T, S), or None with is_causal=True.
    """
    if attention_mask is None and window is None:
        return None, True
    mask = (
        causal_mask(T, S, device) if window is None else sliding_window_mask(T, window, S, device)
    )
    if attention_mask is not None:
        mask = mask & padding_mask(attention_mask)  # (B, 1, T, S)
    return mask, False


def custom_attention_mask(
    attn_mask: Tensor, B: int, T: int, attention_mask: Tensor | None
) -> Tensor:
    """A caller's (T, T) or (B, T, T) self-attention mask, checked, with the padding mask.

    Args:
        attn_mask: bool (T, T) or (B, T, T), True = query i may attend to key j.
        B, T: batch and length of the ids.  attention_mask: (B, T) True = real token, or None.

    Returns:
        bool (T, T) or (B, 1, T, T).
    """
    shapes = ((T, T), (B, T, T))
    if attn_mask.dtype != torch.bool or tuple(attn_mask.shape) not in shapes:
        raise ValueError(
            f"attn_mask must be a bool tensor of shape {shapes[0]} or {shapes[1]} (True = may "
            f"attend), got {attn_mask.dtype} {tuple(attn_mask.shape)}"
        )
    mask = attn_mask if attn_mask.dim() == 2 else attn_mask[:, None]  # (T, T) or (B, 1, T, T)
    if attention_mask is not None:
        mask = mask & padding_mask(attention_mask)  # (B, 1, T, T)
    return mask


def evaluate_mask_mod(mask_mod: MaskMod, B: int, T: int, device=None) -> Tensor:
    """A mask_mod's dense (B, T, T) bool mask, evaluated at every (b, i, j) by broadcasting.

    The head index is 0: a mask given to a model is the same for every head.

    Returns:
        bool (B, T, T), True = query i may attend to key j.
    """
    b = torch.arange(B, device=device).view(B, 1, 1)  # (B, 1, 1)
    h = torch.zeros((), dtype=torch.long, device=device)
    i = torch.arange(T, device=device).view(1, T, 1)  # (1, T, 1)
    j = torch.arange(T, device=device).view(1, 1, T)  # (1, 1, T)
    try:
        mask = torch.as_tensor(mask_mod(b, h, i, j))
    except (IndexError, RuntimeError) as err:
        raise ValueError(
            f"attn_mask: the mask_mod failed on a batch of B={B}, T={T} ({err}); it must take "
            "(b, h, i, j) index tensors of that batch and length"
        ) from err
    if mask.dtype != torch.bool:
        raise ValueError(
            f"attn_mask: a mask_mod must return bool (True = may attend), got {mask.dtype}"
        )
    shape = tuple(mask.shape)
    if len(shape) > 3 or any(n not in (1, m) for n, m in zip(shape[::-1], (T, T, B))):
        raise ValueError(
            f"attn_mask: the mask_mod returned shape {shape}, which does not "
            f"broadcast to (B, T, T) = {(B, T, T)}; index it with (b, h, i, j) only"
        )
    return mask.expand(B, T, T)


def mask_from_mod(
    mask_mod: MaskMod, B: int, T: int, attention_mask: Tensor | None, flex: bool, device
) -> Tensor | BlockMask:
    """A caller's mask_mod as what the layers' backend takes, built once per forward.

    Args:
        mask_mod: (b, h, i, j) -> bool, True = query i of row b may attend to key j.
        B, T: batch and length of the ids.  attention_mask: (B, T) True = real token, or None.
        flex: every self-attention layer uses the "flex" backend: build a BlockMask.

    Returns:
        A BlockMask of shape (B, 1, T, T) (flex), else bool (B, 1, T, T).
    """
    if not flex:
        return custom_attention_mask(
            evaluate_mask_mod(mask_mod, B, T, device), B, T, attention_mask
        )
    mod = mask_mod
    if attention_mask is not None:
        valid = attention_mask.bool()  # (B, T)

        def mod(b, h, i, j):
            return mask_mod(b, h, i, j) & valid[b, j]

    try:
        return block_mask(mod, B, None, T, T, device)
    except (IndexError, RuntimeError) as err:
        raise ValueError(
            f"attn_mask: the mask_mod failed on a batch of B={B}, T={T} ({err}); it must take "
            "(b, h, i, j) indices of that batch and length"
        ) from err


def cached_attention_mask(slots: Tensor, key_valid: Tensor, window: int | None) -> Tensor:
    """The self-attention mask against a preallocated cache.

    Query at slot s sees slots <= s (unwritten later slots stay hidden), within the window, that
    hold real tokens.

    Args:
        slots: (T,) slots of the new tokens.  key_valid: (B, S_max) False for padding.

    Returns:
        (B, 1, T, S_max) bool.
    """
    q = slots[:, None]  # (T, 1)
    k = torch.arange(key_valid.shape[1], device=slots.device)[None, :]  # (1, S_max)
    mask = k <= q  # (T, S_max)
    if window is not None:
        mask = mask & (k > q - window)
    return mask & key_valid[:, None, None, :]  # (B, 1, T, S_max)


def is_mask_mod(attn_mask) -> bool:
    """Whether a model's `attn_mask` argument is a mask_mod (a function) rather than a tensor."""
    return callable(attn_mask) and not isinstance(attn_mask, Tensor)


def uses_flex(model: nn.Module) -> bool:
    """Whether every self-attention layer of `model` runs on the "flex" backend."""
    backends = [
        m.backend for m in model.modules() if hasattr(m, "backend") and not getattr(m, "cross", 0)
    ]
    return bool(backends) and all(b == "flex" for b in backends)


class DecoderLM(nn.Module):
    """A stack of causal blocks that maps token ids to next-token logits.

    Args:
        embed: TokenEmbedding (V, C).  positions: the position scheme (shared by all blocks).
        blocks: DecoderBlocks.  norm: final norm or Identity.  head: Linear(C, V), maybe tied.
        dropout: on the embeddings.  window: sliding window of self-attention, or None.
        head_scale: multiplies the final hidden state (T5 v1.0's tied head: d_model^-0.5).
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
    ):
        super().__init__()
        self.embed, self.positions = embed, positions
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head = norm, head
        self.drop = nn.Dropout(dropout)
        self.window, self.head_scale = window, head_scale

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
            cache: a ModelCache (components/kv_cache.py), a PagedStep
                (components/paged_kv_cache.py), or None.
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
        x = self.drop(self.positions.embed(self.embed(ids), pos))  # (B, T, C)
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
            (ctx, pos): the AttentionContext, and the positions of `ids`, (T,) or (B, T).
        """
        B, T = ids.shape
        if attn_mask is not None and cache is not None:
            raise ValueError("attn_mask cannot be used with a KV cache; pass cache=None")
        if cache is None:
            bound = T if pos is None else None  # default positions: all below T, known from shape
            pos = torch.arange(T, device=ids.device) if pos is None else pos
            k_pos = pos
            if attn_mask is None:
                mask, is_causal = self_attention_mask(T, T, attention_mask, self.window, ids.device)
            elif is_mask_mod(attn_mask):
                flex = uses_flex(self)
                mask = mask_from_mod(attn_mask, B, T, attention_mask, flex, ids.device)
                is_causal = False
            else:
                mask, is_causal = custom_attention_mask(attn_mask, B, T, attention_mask), False
        elif slots.dim() == 2:  # per-row slots (B, T): a PagedStep (components/paged_kv_cache.py)
            pos, k_pos, bound = cache.pos, cache.key_pos, cache.bound  # (B, T), (B, S)
            mask, is_causal = cache.attention_mask(self.window), False
        else:
            pos, k_pos = cache.pos[:, slots], cache.pos  # (B, T), (B, S_max)
            bound = k_pos.shape[1]  # a row's positions never exceed its slots
            mask, is_causal = cached_attention_mask(slots, cache.key_valid, self.window), False
        ctx = AttentionContext(
            mask=mask,
            is_causal=is_causal,
            positions=self.positions.prepare(pos, k_pos, bound),
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
            x = block(x, ctx, layer, cross)  # (B, T, C)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """Final norm and LM head: hidden states (B, T, C) -> logits (B, T, V)."""
        x = self.norm(x)  # (B, T, C)
        if self.head_scale != 1.0:
            x = x * self.head_scale
        return self.head(x)  # (B, T, V)
