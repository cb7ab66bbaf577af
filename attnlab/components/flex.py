"""The "flex" attention backend: score biases and masks as functions, never as (T, S) tensors.

FlexAttention (PyTorch's `torch.nn.attention.flex_attention`, He et al. 2024) takes attention's
two variable parts as small functions of one score's indices, and torch.compile fuses them into
one blocked kernel:

    score_mod(score, b, h, i, j) -> score    what a bias adds        (ALiBi, T5 relative bias)
    mask_mod(b, h, i, j) -> bool             which keys may be seen  (causal, window, prefix, ...)

    out = softmax(score_mod(Q K^T * scale) where mask_mod, else -inf) V

A mask_mod is first evaluated once per (query block, key block) into a `BlockMask`: blocks that
are entirely masked are skipped, blocks that are entirely visible skip the mask, and only the
partial ones (the diagonal of a causal mask) evaluate it per score. So a position bias costs a
few numbers per head (the ALiBi slopes, a T5 bias per relative distance) instead of an
(H, T, S) float tensor, and a causal or sliding-window mask costs about half or T / window of
the blocks instead of all of them.

In this backend `bias` may be a score_mod (what the position schemes' `score_mod` form gives,
see positions/base.py) or a dense tensor (read through a score_mod that indexes it); `mask` may
be a `BlockMask` built once per forward (`block_mask`), or a dense bool tensor (read the same
way).

Training: on CUDA the backward is PyTorch's own FlexAttention backward. PyTorch 2.13 has none on
CPU (and its compiled CPU kernel cannot return the log-sum-exp a recomputing backward needs), so
there, when an input requires grad, the same mask_mod / score_mod go through the written flash
backend instead (components/flash.py: the tiled forward and its recomputing backward, which
evaluates the functions tile by tile and gives a score_mod's learned tensors, T5's bias table,
their gradients). Without gradients (inference) the CPU runs the compiled flex kernel.

Shapes: B batch, H query heads, K kv heads, T queries, S keys, D head_dim.
"""

from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from attnlab.components.flash import MaskMod, ScoreMod, flash_attention, score_mod_tensors

# PyTorch 2.13's compiled CPU FlexAttention gives wrong rows for head dims under 32 at some
# lengths on an AVX2-only CPU (AMD EPYC, measured: D 8 and 16 at T = S = 8, 24 or 56, rows of
# the last batch and head off by up to 2, or NaN; D 32 and 64 right at every length tried; an
# AVX-512 Xeon passed them all). The backend pads q, k and v with zero features up to 32, which
# leaves every score, and so the output's first D features, as they were.
CPU_MIN_HEAD_DIM = 32


@lru_cache(maxsize=1)
def compiled_flex_attention() -> Callable[..., Tensor]:
    """`flex_attention` compiled once per process (uncompiled it builds the dense scores)."""
    return torch.compile(flex_attention, dynamic=False)


def block_mask(
    mask_mod: MaskMod, B: int | None, H: int | None, T: int, S: int, device=None
) -> BlockMask:
    """Evaluate `mask_mod` per block of scores once; hand the result to every layer.

    Args:
        mask_mod: (b, h, i, j) -> bool.
        B, H: batch and heads the mask depends on; None when it is the same for all.
        T, S: query and key lengths.

    Returns:
        A BlockMask of shape (B or 1, H or 1, T, S).
    """
    return create_block_mask(mask_mod, B, H, T, S, device=device)


@lru_cache(maxsize=8)
def causal_block_mask(T: int, S: int, device: torch.device) -> BlockMask:
    """The causal BlockMask (queries are the last T of S positions); it depends only on shapes."""
    offset = S - T

    def causal(b, h, i, j):
        return j <= i + offset

    return block_mask(causal, None, None, T, S, device)


def _dense_mask_mod(mask: Tensor, B: int, H: int, T: int, S: int) -> tuple[MaskMod, int, int]:
    """A mask_mod that reads a dense bool mask broadcastable to (B, H, T, S)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, T|1, S)
    Bm, Hm = mask.shape[0], mask.shape[1]
    mask = mask.expand(Bm, Hm, T, S)  # a view: broadcasting, no copy

    def dense(b, h, i, j):
        return mask[b if Bm > 1 else 0, h if Hm > 1 else 0, i, j]

    return dense, Bm, Hm


def _dense_score_mod(bias: Tensor) -> ScoreMod:
    """A score_mod that adds a dense (H, T, S) or (B, H, T, S) bias (it is read, not built)."""
    bias = bias if bias.dim() == 4 else bias.unsqueeze(0)  # (B|1, H, T, S)
    batched = bias.shape[0] > 1

    def add_bias(score, b, h, i, j):
        return score + bias[b if batched else 0, h, i, j]

    add_bias.additive = True  # dS passes back unchanged (components/flash.py)
    return add_bias


def flex_attention_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | BlockMask | None = None,
    bias: Tensor | ScoreMod | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, None]:
    """Attention through compiled FlexAttention; arguments as `backends.eager_attention`.

    On the CPU, when q, k, v or the bias (a score_mod's `tensors`) require grad, this runs
    `flash.flash_attention` on the same arguments instead: the only backward there is.

    Args:
        q: (B, H, T, D).  k, v: (B, K, S, D), K divides H (GQA without repeating K/V).
        mask: a BlockMask, or bool broadcastable to (B, H, T, S) (True = may attend), or None.
        bias: a score_mod (score, b, h, i, j) -> score, or a float tensor broadcastable to
            (B, H, T, S) added to the scores, or None.
        is_causal: also apply a causal mask (queries are the last T of S positions).
        scale: score scale; None -> 1 / sqrt(D).
        dropout: must be 0 (FlexAttention has no attention dropout).
        return_weights: must be False (use backend="eager" for pictures).

    Returns:
        out: (B, H, T, D), zeros in rows that may attend to nothing (as the eager path); None.
    """
    if return_weights:
        raise ValueError("the flex backend cannot return attention weights; use backend='eager'")
    if dropout > 0:
        raise ValueError(
            f"the flex backend has no attention dropout, got dropout={dropout}; set dropout=0 "
            "or use backend='sdpa'"
        )
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if isinstance(mask, BlockMask) and is_causal:
        raise ValueError("pass is_causal=False with a BlockMask: build the causal part into it")
    if _needs_written_backward(q, k, v, bias):
        return flash_attention(q, k, v, mask, bias, is_causal, scale)
    if isinstance(mask, BlockMask):
        blocks = mask
    elif mask is not None:
        mod, Bm, Hm = _dense_mask_mod(mask, B, H, T, S)
        if is_causal:
            offset, dense = S - T, mod

            def mod(b, h, i, j):
                return dense(b, h, i, j) & (j <= i + offset)

        blocks = block_mask(mod, Bm if Bm > 1 else None, Hm if Hm > 1 else None, T, S, q.device)
    elif is_causal:
        blocks = causal_block_mask(T, S, q.device)
    else:
        blocks = None
    score_mod = _dense_score_mod(bias) if isinstance(bias, Tensor) else bias
    D = q.shape[-1]
    if q.device.type == "cpu" and D < CPU_MIN_HEAD_DIM:  # see CPU_MIN_HEAD_DIM
        scale = D**-0.5 if scale is None else scale
        q, k, v = (torch.nn.functional.pad(t, (0, CPU_MIN_HEAD_DIM - D)) for t in (q, k, v))
    out = compiled_flex_attention()(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=blocks,
        scale=scale,
        enable_gqa=k.shape[1] != H,
    )  # (B, H, T, D), or D padded
    return out[..., :D], None


def _needs_written_backward(q: Tensor, k: Tensor, v: Tensor, bias) -> bool:
    """True when a gradient is wanted on a device without a FlexAttention backward (the CPU)."""
    if q.device.type != "cpu" or not torch.is_grad_enabled():
        return False
    learned = (bias,) if isinstance(bias, Tensor) else score_mod_tensors(bias)
    return any(t.requires_grad for t in (q, k, v, *learned))


def dense_terms(
    mask: Tensor | BlockMask | None, bias: Tensor | ScoreMod | None, B: int, H: int, T: int, S: int
) -> tuple[Tensor | None, Tensor | None]:
    """A flex layer's mask and bias as the dense tensors the eager path takes (for pictures).

    A BlockMask's mask_mod and a score_mod are evaluated on every (b, h, i, j) by broadcasting
    index tensors, which builds what the flex path never does: (B, H, T, S) tensors. So only
    a watched `hook_pattern` (attention maps, at picture sizes; components/hooks.py) calls this.

    Returns:
        (mask bool (B, H, T, S) or as given, bias float (B, H, T, S) or as given).
    """
    idx = [
        torch.arange(n).view([-1 if d == k else 1 for d in range(4)])
        for k, n in enumerate((B, H, T, S))
    ]  # b (B,1,1,1), h (1,H,1,1), i (1,1,T,1), j (1,1,1,S)
    if isinstance(mask, BlockMask):
        b, h, i, j = (t.to(mask.kv_num_blocks.device) for t in idx)
        mask = mask.mask_mod(b, h, i, j).expand(B, H, T, S)
    if callable(bias) and not isinstance(bias, Tensor):
        device = mask.device if isinstance(mask, Tensor) else None
        b, h, i, j = (t.to(device) for t in idx)
        bias = bias(torch.zeros(B, H, T, S, device=device), b, h, i, j)
    return mask, bias
