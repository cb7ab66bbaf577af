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
"""

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

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
