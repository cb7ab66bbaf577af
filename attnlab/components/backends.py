"""Scaled dot-product attention, two ways: written out ("eager") and PyTorch's fused kernel
("sdpa").

    Attention(Q, K, V) = softmax(Q K^T * scale + bias, masked) V        (Vaswani et al. 2017, eq. 1)

Both take the same arguments and give the same numbers; only the eager path can return the
probabilities (for pictures), and only the sdpa path reaches the flash / memory-efficient kernels,
which never materialise the (T, S) score matrix. A float `bias` (ALiBi, T5) turns the boolean mask
into an additive float mask, which keeps SDPA off its flash kernel.

The "auto" backend is SDPA, except for a call whose mask or bias is a function only FlexAttention
reads (a BlockMask, a score_mod): that one goes through flex. Which form the terms take is decided
once per forward by whoever builds them (a position scheme with bias_form "auto", see
positions/base.py `wants_score_mod`); each layer only follows it.

Shapes: B batch, H query heads, K kv heads, G = H // K, T queries, S keys, D head_dim.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnlab.components.flash import flash_attention
from attnlab.components.flex import flex_attention_backend
from attnlab.components.masks import causal_mask
from attnlab.components.softcap import soft_cap
from attnlab.components.triton_attention import triton_attention

Backend = Literal["sdpa", "eager", "flash", "flex", "triton", "auto"]


def repeat_kv(x: Tensor, G: int) -> Tensor:
    """Share each kv head with G query heads (GQA/MQA).

        kv heads:    k0          k1
        query heads: q0 q1 q2    q3 q4 q5     (G = 3)

    Args:
        x: (B, K, S, D).

    Returns:
        (B, K * G, S, D), head h reading kv head h // G.
    """
    if G == 1:
        return x
    B, K, S, D = x.shape
    return x[:, :, None].expand(B, K, G, S, D).reshape(B, K * G, S, D)  # (B, H, S, D)


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention written out step by step; softmax in fp32; fully masked rows give zeros.

    Args:
        q: (B, H, T, D) queries.  k, v: (B, K, S, D) keys and values, K divides H.
        mask: bool, broadcastable to (B, H, T, S), True = may attend.
        bias: float, broadcastable to (B, H, T, S), added to the scores.
        is_causal: also apply a causal mask (queries are the last T of S positions).
        scale: score scale; None -> 1 / sqrt(D).
        dropout: dropout probability on the attention probabilities.
        return_weights: also return the probabilities.
        softcap: soft-cap the scaled scores at this value before bias and mask (Gemma 2,
            components/softcap.py), or None.

    Returns:
        out: (B, H, T, D); weights: (B, H, T, S) fp32 probabilities, or None.
    """
    scores, mask = attention_scores(q, k, mask, bias, is_causal, scale, softcap)  # fp32
    probs = attention_probs(scores, mask)  # (B, H, T, S)
    attn = F.dropout(probs, p=dropout) if dropout > 0 else probs
    v = repeat_kv(v, q.shape[1] // v.shape[1])  # (B, H, S, D)
    out = (attn @ v.float()).to(q.dtype)  # (B, H, T, D)
    return out, (probs if return_weights else None)


def attention_scores(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The eager path's first half: Q K^T * scale (soft-capped) + bias, -inf where masked.

    Args: as `eager_attention`.

    Returns:
        scores (B, H, T, S) fp32, and the mask applied (with the causal part), or None.
    """
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    S = k.shape[2]
    k = repeat_kv(k, H // k.shape[1])  # (B, H, S, D)
    scale = D**-0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, S), fp32
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        mask = _with_causal(mask, T, S, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores, mask


def attention_probs(scores: Tensor, mask: Tensor | None) -> Tensor:
    """The eager path's softmax: scores (B, H, T, S) -> probabilities, masked entries exactly 0."""
    probs = torch.softmax(scores, dim=-1)  # a fully masked row is all NaN here
    if mask is not None:
        # exp(-inf) everywhere gives 0/0: such a row attends to nothing, so it reads nothing.
        probs = probs.masked_fill(~mask, 0.0)
    return probs


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, None]:
    """The same computation through `F.scaled_dot_product_attention` (flash / efficient / math).

    Arguments and shapes as `eager_attention`; `return_weights` is not supported here.
    """
    if return_weights:
        raise ValueError("the sdpa backend cannot return attention weights; use backend='eager'")
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    G = H // k.shape[1]
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (B, H, S, D)
    if mask is None and bias is None and (not is_causal or T == S):
        # The fast path: no mask tensor at all lets SDPA pick its flash kernel.
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=is_causal, scale=scale
        ), None
    if is_causal:
        mask = _with_causal(mask, T, S, q.device)
    attn_mask = mask
    if bias is not None:
        attn_mask = (
            bias.to(q.dtype) if mask is None else bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale
    )
    if mask is not None:
        # SDPA leaves NaN in rows that may attend to nothing; the eager path's convention is zeros.
        out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # (B, H, T, D)
    return out, None


def _with_causal(mask: Tensor | None, T: int, S: int, device) -> Tensor:
    """`mask` AND a causal (T, S) mask."""
    causal = causal_mask(T, S, device=device)  # (T, S)
    return causal if mask is None else mask & causal


def auto_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | BlockMask | None = None,
    bias=None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The flex backend for a BlockMask or a score_mod bias, the sdpa backend for tensors.

    Arguments and shapes as `eager_attention`, except that `mask` may be a BlockMask and `bias` a
    score_mod (score, b, h, i, j) -> score, as the flex backend takes them.
    """
    as_functions = isinstance(mask, BlockMask) or (bias is not None and callable(bias))
    attend = BACKENDS["flex" if as_functions else "sdpa"]  # looked up per call: tests spy on it
    return attend(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        scale=scale,
        dropout=dropout,
        return_weights=return_weights,
    )


BACKENDS = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "flex": flex_attention_backend,
    "triton": triton_attention,  # FlashAttention-2 in Triton: CUDA (or TRITON_INTERPRET=1)
    "auto": auto_attention,  # flex where the terms are functions, sdpa elsewhere
}
