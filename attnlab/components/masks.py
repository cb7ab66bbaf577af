"""Attention masks, one convention everywhere: boolean, True = may attend (as PyTorch SDPA).

Every builder returns a tensor that broadcasts against scores shaped (B, H, T, S):
(T, S) when all rows share it, (B, 1, T, S) when it depends on the batch row. Combine masks with
`&`.
Each builder also has a `*_mask_mod` form for the flex backend (components/flex.py): a function
(b, h, i, j) -> bool of one score's indices, so that no (T, S) tensor is built at all; combine
those with `and_masks` / `or_masks` from `torch.nn.attention.flex_attention`.

    causal (T=S=4)    sliding window 2    prefix-LM, prefix 2    padding [1 1 1 0]
    # . . .           # . . .             # # . .                # # # .
    # # . .           # # . .             # # . .                # # # .
    # # # .           . # # .             # # # .                # # # .
    # # # #           . . # #             # # # #                # # # .

What a model builds from these once per forward (the decoder and the encoder share them):
`self_attention_mask` (causal, windowed, padded), `custom_attention_mask` and `mask_from_mod`
(a caller's mask, a tensor or a mask_mod), `cached_attention_mask` (against a static cache).
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from attnlab.components.flex import block_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""(b, h, i, j) -> True where query i of row b, head h may attend to key j (0-d tensors)."""


def causal_mask(T: int, S: int | None = None, device=None) -> Tensor:
    """Lower-triangular mask: query i sees keys j <= i + (S - T).

    With a cache, the T new queries are the last T of S positions, hence the offset S - T.

    Returns:
        (T, S) bool.
    """
    S = T if S is None else S
    q = torch.arange(S - T, S, device=device)[:, None]  # (T, 1) absolute query positions
    k = torch.arange(S, device=device)[None, :]  # (1, S)
    return k <= q


def sliding_window_mask(T: int, window: int, S: int | None = None, device=None) -> Tensor:
    """Causal mask that also forgets keys more than `window - 1` positions back (Mistral).

    Each query sees itself and the `window - 1` keys before it.

    Returns:
        (T, S) bool.
    """
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got window={window}")
    S = T if S is None else S
    q = torch.arange(S - T, S, device=device)[:, None]  # (T, 1)
    k = torch.arange(S, device=device)[None, :]  # (1, S)
    return (k <= q) & (k > q - window)


def padding_mask(attention_mask: Tensor, T: int | None = None) -> Tensor:
    """Key-padding mask from a per-token validity mask.

    Args:
        attention_mask: (B, S) bool or 0/1, True/1 = a real token, False/0 = padding.
        T: query length; when given, the mask is expanded to (B, 1, T, S).

    Returns:
        (B, 1, 1, S) bool (or (B, 1, T, S) when T is given).
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, S), got shape {tuple(attention_mask.shape)}")
    m = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    return m if T is None else m.expand(-1, -1, T, -1)


def prefix_lm_mask(T: int, prefix_len: int | Tensor, device=None) -> Tensor:
    """UniLM / prefix-LM mask: the prefix sees itself fully, the rest is causal.

    Args:
        T: sequence length.
        prefix_len: int, or (B,) tensor of per-row prefix lengths.

    Returns:
        (T, T) bool, or (B, 1, T, T) for per-row prefixes.
    """
    causal = causal_mask(T, device=device)  # (T, T)
    k = torch.arange(T, device=device)
    if isinstance(prefix_len, int):
        return causal | (k[None, :] < prefix_len)
    in_prefix = k[None, :] < prefix_len.to(device)[:, None]  # (B, T) keys inside the prefix
    return (causal[None] | in_prefix[:, None, :])[:, None]  # (B, 1, T, T)


def permutation_mask(order: Tensor) -> Tensor:
    """XLNet permutation-LM mask: token at position i sees j iff j comes earlier in `order`.

    Args:
        order: (T,) a permutation of range(T); order[r] is the position predicted r-th.

    Returns:
        (T, T) bool: XLNet's query-stream mask (strictly earlier in the factorisation order);
        the content stream also sees itself: `permutation_mask(order) | torch.eye(T, dtype=bool)`.
    """
    T = order.numel()
    if sorted(order.tolist()) != list(range(T)):
        raise ValueError(f"order must be a permutation of range({T}), got {order.tolist()}")
    rank = torch.empty_like(order)
    rank[order] = torch.arange(T, device=order.device)  # rank[i]: when position i is predicted
    return rank[None, :] < rank[:, None]


def causal_mask_mod(offset: int = 0) -> MaskMod:
    """`causal_mask` as a mask_mod: query i sees keys j <= i + offset (offset = S - T)."""

    def causal(b, h, i, j):
        return j <= i + offset

    return causal


def sliding_window_mask_mod(window: int, offset: int = 0) -> MaskMod:
    """`sliding_window_mask` as a mask_mod: itself and the window - 1 keys before it."""
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got window={window}")

    def sliding_window(b, h, i, j):
        return (j <= i + offset) & (j > i + offset - window)

    return sliding_window


def prefix_lm_mask_mod(prefix_len: int | Tensor) -> MaskMod:
    """`prefix_lm_mask` as a mask_mod.

    Args:
        prefix_len: int, or (B,) tensor of per-row prefix lengths (the mask then reads row b).
    """
    if isinstance(prefix_len, int):

        def prefix_lm(b, h, i, j):
            return (j <= i) | (j < prefix_len)

        return prefix_lm

    def prefix_lm_per_row(b, h, i, j):
        return (j <= i) | (j < prefix_len[b])

    return prefix_lm_per_row


def document_mask_mod(doc_ids: Tensor, causal: bool = True) -> MaskMod:
    """Packed sequences: a token sees only tokens of its own document (causally, by default).

        doc_ids [0 0 1 1 1], causal:
        # . . . .
        # # . . .
        . . # . .
        . . # # .
        . . # # #

    Args:
        doc_ids: (T,) or (B, T) int document id of every token (queries and keys alike).
        causal: also hide later tokens of the same document.
    """
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be (T,) or (B, T), got shape {tuple(doc_ids.shape)}")
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids[None]  # (B|1, T)
    batched = ids.shape[0] > 1

    def document(b, h, i, j):
        row = b if batched else 0
        same = ids[row, i] == ids[row, j]
        return same & (j <= i) if causal else same

    return document


def permutation_mask_mod(order: Tensor, include_self: bool = False) -> MaskMod:
    """`permutation_mask` as a mask_mod (XLNet): i sees j iff j comes earlier in `order`.

    Args:
        order: (T,) a permutation of range(T); order[r] is the position predicted r-th.
        include_self: also see itself (XLNet's content stream); False is the query stream.
    """
    T = order.numel()
    if sorted(order.tolist()) != list(range(T)):
        raise ValueError(f"order must be a permutation of range({T}), got {order.tolist()}")
    rank = torch.empty_like(order)
    rank[order] = torch.arange(T, device=order.device)  # rank[i]: when position i is predicted

    def permutation(b, h, i, j):
        return (rank[j] <= rank[i]) if include_self else (rank[j] < rank[i])

    return permutation


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


def check_mask(mask: Tensor | BlockMask, B: int, H: int, T: int, S: int) -> None:
    """Raise a ValueError unless `mask` is a bool tensor that broadcasts to (B, H, T, S).

    A BlockMask (the flex backend's form) must have exactly T queries and S keys.
    """
    if isinstance(mask, BlockMask):
        if tuple(mask.shape[-2:]) != (T, S):
            raise ValueError(
                f"BlockMask of shape {tuple(mask.shape)} does not match T={T}, S={S}; "
                "build it for these lengths"
            )
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"masks are boolean (True = may attend), got dtype {mask.dtype}")
    shape = tuple(mask.shape)
    ok = 2 <= len(shape) <= 4 and shape[-1] == S and shape[-2] in (1, T)
    if ok and len(shape) >= 3:
        ok = shape[-3] in (1, H) and (len(shape) == 3 or shape[0] in (1, B))
    if not ok:
        raise ValueError(
            f"mask of shape {shape} does not broadcast to scores (B={B}, H={H}, T={T}, S={S}); "
            "expected (T, S), (B, 1, T, S) or (B, 1, 1, S)"
        )


def format_mask(mask: Tensor, on: str = "#", off: str = ".") -> str:
    """Draw a 2-D mask as a text grid, one row per query (of a batched mask: pass mask[b, 0])."""
    if mask.dim() != 2:
        raise ValueError(f"format_mask draws a 2-D (T, S) mask, got shape {tuple(mask.shape)}")
    return "\n".join(" ".join(on if v else off for v in row) for row in mask.tolist())
