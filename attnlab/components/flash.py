"""FlashAttention-2 written out in PyTorch: tiles, the online softmax, and a recomputing backward.

The "flash" backend computes exactly what `eager_attention` computes,

    O = softmax(S) V,    S = Q K^T * scale + bias  (masked entries -inf),

without ever holding the (T, S) score matrix. It is a teaching implementation of the algorithm
(Dao 2023, "FlashAttention-2", Algorithms 1 and 2): the loops are Python loops over blocks, and
each block is a few PyTorch matmuls. Speed belongs to fused kernels; this file shows why they
need only O(T) extra memory.

Forward, for one query block Q_i (Br rows) and the key/value blocks K_j, V_j (Bc rows) in turn:

    S_ij  = Q_i K_j^T * scale + bias_ij              (Br, Bc) scores, masked entries -inf
    m_new = max(m, rowmax(S_ij))                     running max of every score seen so far
    P_ij  = exp(S_ij - m_new)                        unnormalised probabilities of this block
    l     = exp(m - m_new) * l + rowsum(P_ij)        running sum, rescaled to the new max
    O_i   = exp(m - m_new) * O_i + P_ij V_j          running output, rescaled the same way
    m     = m_new

and after the last key block O_i = O_i / l (the division happens once, not per block) and the
log-sum-exp L_i = m + log(l) is saved, one number per query row. Subtracting the running max
keeps every exp() <= 1 (the softmax's usual safety), and rescaling by exp(m - m_new) corrects
what was accumulated under an older, smaller max: at the end O_i = sum_j exp(S_ij - L_i) V_j,
which is softmax(S) V.

Backward (as a `torch.autograd.Function`): with L saved, any block of probabilities comes back
exactly as P_ij = exp(S_ij - L_i), so nothing (T, S) is stored between forward and backward. With
D_i = rowsum(dO_i * O_i) (equal to rowsum(P_i * dP_i)), for each key block j and query block i:

    dV_j += P_ij^T dO_i
    dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - D_i)                     the softmax's Jacobian, row by row
    dQ_i += dS_ij K_j * scale
    dK_j += dS_ij^T Q_i * scale                      (and d bias_ij = dS_ij, when bias learns)

Masks: causal masking skips the key blocks entirely above the diagonal (the T queries are the
last T of S keys, as with a cache). A boolean `mask` (True = may attend) and a float `bias`
(ALiBi, T5) come in two forms, and one function (`_modify_scores`) knows both:

    tensors    broadcastable to (B, H, T, S); each tile reads its slice of the broadcast view
    functions  FlexAttention's forms (components/flex.py): a mask_mod (b, h, i, j) -> bool and a
               score_mod (score, b, h, i, j) -> score, called once per tile on index tensors
               shaped to broadcast against the (B, K, G, Br, Bc) tile, so neither form ever
               builds a (T, S) tensor. A `BlockMask` is read through its mask_mod, and its
               block sparsity skips the tiles in which no query may see any key.

A score_mod's learned tensors (T5's bias table) live in its closure, where an autograd.Function
cannot see them, so a score_mod lists them in a `tensors` attribute (`score_mod_tensors`); they
become extra inputs of the Function, and the backward gets their gradient tile by tile as
d tensors += (d score_mod / d tensors)^T dS_ij, by `torch.autograd.grad` through the tile's
score_mod (which also gives dS_ij's way back through the score_mod to Q K^T). A dense bias
tensor that learns gets dS itself, a (B, H, T, S) tensor like the bias.

A row that may attend to nothing has l = 0: its output is zeros (the eager path's convention) and
its L is +inf, so that every recomputed P in that row is exp(-inf) = 0, never NaN.

GQA/MQA: the H query heads are viewed as (K, G) and each kv head is broadcast over its G query
heads inside the matmul, so K and V are never repeated in memory.

Shapes: B batch, H query heads, K kv heads, G = H // K, T queries, S keys, D head_dim,
Br / Bc query / key block sizes.
"""

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""(score, b, h, i, j) -> the modified score (FlexAttention's form; see flex.py)."""
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""(b, h, i, j) -> True where query i of row b, head h may attend to key j."""

# Default block sizes (rows of Q and of K/V per tile). Each tile costs a few Python-level tensor
# calls, so on a CPU larger tiles than a GPU kernel's SRAM would hold pay off; the memory stays
# O(T): a few (Br, Bc) tiles at a time.
BLOCK_Q, BLOCK_K = 256, 256


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | MaskMod | BlockMask | None = None,
    bias: Tensor | ScoreMod | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[Tensor, Tensor | None]:
    """FlashAttention-2 forward and backward, written in PyTorch; same arguments as eager.

    Args:
        q: (B, H, T, D) queries.  k, v: (B, K, S, D) keys and values, K divides H.
        mask: bool, broadcastable to (B, H, T, S), True = may attend; or a mask_mod
            (b, h, i, j) -> bool; or a BlockMask (its mask_mod is read, and tiles with no
            visible block are skipped).
        bias: float, broadcastable to (B, H, T, S), added to the scores (may require grad); or a
            score_mod (score, b, h, i, j) -> score, whose `tensors` attribute lists the tensors
            it reads that may require grad (see `score_mod_tensors`).
        is_causal: also apply a causal mask (queries are the last T of S positions).
        scale: score scale; None -> 1 / sqrt(D).
        dropout: must be 0 (this backend is dropout-free).
        return_weights: also return the probabilities, recomputed from the saved log-sum-exp.
        block_q: query rows per tile (Br).
        block_k: key rows per tile (Bc).

    Returns:
        out: (B, H, T, D) in q's dtype; weights: (B, H, T, S) fp32 probabilities, or None.
    """
    if dropout > 0:
        raise ValueError(
            f"the flash backend is dropout-free, got dropout={dropout}; "
            "set attention dropout to 0 or use backend='eager' or 'sdpa'"
        )
    if block_q < 1 or block_k < 1:
        raise ValueError(
            f"flash block sizes must be >= 1, got block_q={block_q}, block_k={block_k}"
        )
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise ValueError(
            f"the flash backend wants a bool mask (True = may attend), got {mask.dtype}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    learned = () if isinstance(bias, Tensor) else score_mod_tensors(bias)
    out, lse = FlashAttention.apply(
        q, k, v, mask, bias, is_causal, scale, block_q, block_k, *learned
    )
    weights = None
    if return_weights:
        weights = flash_probabilities(q, k, lse, mask, bias, is_causal, scale)
    return out, weights


def score_mod_tensors(score_mod: ScoreMod | None) -> tuple[Tensor, ...]:
    """The tensors a score_mod reads that may need a gradient: its `tensors` attribute, or ().

    The position schemes set it (T5's gathered bias table, ALiBi's slopes), e.g.
    `t5_bias.tensors = (by_distance,)`, so that `FlashAttention` can take them as inputs. They
    also set `additive = True`: the score_mod returns score + a bias that does not depend on the
    score, so its derivative by the score is 1 and the backward hands dS through unchanged.
    """
    return tuple(getattr(score_mod, "tensors", ()))


def flash_probabilities(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    mask: Tensor | MaskMod | None = None,
    bias: Tensor | ScoreMod | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The attention probabilities P = exp(Q K^T * scale + bias - L), from the saved L.

    A second pass for pictures (viz sizes): one exp per score and no softmax, because L already
    holds each row's normaliser. Rows that attend to nothing have L = +inf and give zeros.

    Args:
        q: (B, H, T, D).  k: (B, K, S, D).
        lse: (B, H, T) log-sum-exp L of each query row, from the flash forward.
        mask, bias, is_causal, scale: as in `flash_attention`.

    Returns:
        (B, H, T, S) fp32 probabilities.
    """
    B, H, T, D = q.shape
    Kh, S = k.shape[1], k.shape[2]
    G = H // Kh
    scale = D**-0.5 if scale is None else scale
    acc_t = _accumulate_dtype(q)
    qg = q.to(acc_t).reshape(B, Kh, G, T, D)  # (B, K, G, T, D)
    kg = k.to(acc_t)[:, :, None]  # (B, K, 1, S, D)
    scores = _block_scores(qg, kg, mask, bias, is_causal, scale, (0, T), (0, S), T, S)
    lse = lse.reshape(B, Kh, G, T, 1)
    return torch.exp(scores - lse).reshape(B, H, T, S)  # (B, H, T, S)


class FlashAttention(torch.autograd.Function):
    """O and L from the tiled forward; dQ, dK, dV (and d bias) from the recomputing backward.

    Inputs: q, k, v, mask, bias, is_causal, scale, block_q, block_k, then the tensors the bias
    score_mod reads (`score_mod_tensors(bias)`), which get their gradients too.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, is_causal, scale, block_q, block_k, *learned):
        """Returns out (B, H, T, Dv) in q's dtype and L (B, H, T) fp32 (not differentiable)."""
        B, H, T, D = q.shape
        Kh, S = k.shape[1], k.shape[2]
        G = H // Kh
        Dv = v.shape[-1]  # the value width (MLA's may differ from D)
        new = dict(dtype=_accumulate_dtype(q), device=q.device)  # fp32, or fp64 for gradcheck
        qg = q.to(new["dtype"]).reshape(B, Kh, G, T, D)  # (B, K, G, T, D): grouped by kv head
        kg = k.to(new["dtype"])[:, :, None]  # (B, K, 1, S, D), broadcast over the G heads
        vg = v.to(new["dtype"])[:, :, None]  # (B, K, 1, S, Dv)
        out = torch.empty(B, Kh, G, T, Dv, **new)
        lse = torch.empty(B, Kh, G, T, **new)
        live = _live_blocks(mask)
        for i0 in range(0, T, block_q):
            i1 = min(i0 + block_q, T)
            qi = qg[..., i0:i1, :]  # (B, K, G, Br, D)
            m = torch.full((B, Kh, G, i1 - i0), float("-inf"), **new)  # running max
            l = torch.zeros(B, Kh, G, i1 - i0, **new)  # running sum  # noqa: E741
            acc = torch.zeros(B, Kh, G, i1 - i0, Dv, **new)  # running output, unnormalised
            for j0 in range(0, _keys_seen(i1, T, S, is_causal), block_k):
                j1 = min(j0 + block_k, S)
                if not _tile_is_live(live, (i0, i1), (j0, j1)):
                    continue  # a BlockMask hides every key of this tile from every query
                s = _block_scores(qi, kg, mask, bias, is_causal, scale, (i0, i1), (j0, j1), T, S)
                m_new = torch.maximum(m, s.amax(dim=-1))  # (B, K, G, Br)
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no key yet
                p = torch.exp(s - m_safe[..., None])  # (B, K, G, Br, Bc)
                alpha = torch.exp(m - m_safe)  # rescales what was summed under the old max
                l = alpha * l + p.sum(dim=-1)  # noqa: E741
                acc = alpha[..., None] * acc + p @ vg[..., j0:j1, :]  # (B, K, G, Br, Dv)
                m = m_new
            seen = l > 0  # False: the row may attend to nothing
            l_safe = l.masked_fill(~seen, 1.0)[..., None]
            out[..., i0:i1, :] = torch.where(seen[..., None], acc / l_safe, 0.0)  # O_i = O_i / l
            lse[..., i0:i1] = torch.where(seen, m + torch.log(l), float("inf"))  # L_i = m + log l
        out = out.reshape(B, H, T, Dv).to(q.dtype)
        lse = lse.reshape(B, H, T)
        tensors = [x if isinstance(x, Tensor) else None for x in (mask, bias)]
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.mods = [None if isinstance(x, Tensor) else x for x in (mask, bias)]  # the functions
        ctx.learned = learned  # as given: the very tensors the score_mod's closure reads
        ctx.is_causal, ctx.scale, ctx.block_q, ctx.block_k = is_causal, scale, block_q, block_k
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        """dQ, dK, dV (and d bias), recomputing each block's P from the saved L."""
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        mask = ctx.mods[0] if mask is None else mask
        bias = ctx.mods[1] if bias is None else bias
        is_causal, scale, block_q, block_k = ctx.is_causal, ctx.scale, ctx.block_q, ctx.block_k
        B, H, T, D = q.shape
        Kh, S = k.shape[1], k.shape[2]
        G = H // Kh
        Dv = v.shape[-1]
        new = dict(dtype=_accumulate_dtype(q), device=q.device)
        qg = q.to(new["dtype"]).reshape(B, Kh, G, T, D)  # (B, K, G, T, D)
        kg = k.to(new["dtype"])[:, :, None]  # (B, K, 1, S, D)
        vg = v.to(new["dtype"])[:, :, None]  # (B, K, 1, S, Dv)
        d_out = d_out.to(new["dtype"]).reshape(B, Kh, G, T, Dv)
        lse = lse.reshape(B, Kh, G, T)
        delta = (d_out * out.to(new["dtype"]).reshape(B, Kh, G, T, Dv)).sum(dim=-1)  # D_i
        dq = torch.zeros_like(qg)  # (B, K, G, T, D)
        dk = torch.zeros(B, Kh, S, D, **new)
        dv = torch.zeros(B, Kh, S, Dv, **new)
        # A learned bias (T5) gets its gradient dS: a (B, H, T, S) tensor, like the bias itself.
        want_dbias = isinstance(bias, Tensor) and ctx.needs_input_grad[4]
        dbias = torch.zeros(B, Kh, G, T, S, **new) if want_dbias else None
        # A score_mod goes through autograd per tile: dS back to Q K^T, and to its learned tensors.
        # An additive one (score + a bias of the indices) passes dS back unchanged, so autograd
        # is needed only for its learned tensors (T5's table), and not at all for ALiBi's slopes.
        learned = [t for t, need in zip(ctx.learned, ctx.needs_input_grad[9:]) if need]
        additive = getattr(bias, "additive", False)
        through_mod = bias is not None and not isinstance(bias, Tensor) and not additive
        graph = through_mod or bool(learned)
        d_learned = [torch.zeros_like(t) for t in learned]
        live = _live_blocks(mask)
        for j0 in range(0, S, block_k):
            j1 = min(j0 + block_k, S)
            kj, vj = kg[..., j0:j1, :], vg[..., j0:j1, :]  # (B, K, 1, Bc, D or Dv)
            for i0 in range(0, T, block_q):
                i1 = min(i0 + block_q, T)
                if j0 >= _keys_seen(i1, T, S, is_causal):
                    continue  # the whole block lies above the diagonal
                if not _tile_is_live(live, (i0, i1), (j0, j1)):
                    continue  # a BlockMask hides it, as in the forward
                qi, doi = qg[..., i0:i1, :], d_out[..., i0:i1, :]  # (B, K, G, Br, D or Dv)
                tile = (mask, bias, is_causal, (i0, i1), (j0, j1), T, S)
                s_raw = (qi @ kj.transpose(-2, -1)) * scale  # (B, K, G, Br, Bc)
                with torch.enable_grad() if graph else nullcontext():  # for dS, below
                    s_raw = s_raw.detach().requires_grad_() if through_mod else s_raw
                    s = _modify_scores(s_raw, *tile)  # (B, K, G, Br, Bc)
                p = torch.exp(s.detach() - lse[..., i0:i1, None])  # (B, K, G, Br, Bc), recomputed
                dv[..., j0:j1, :] += (p.transpose(-2, -1) @ doi).sum(dim=2)  # sum the G heads
                dp = doi @ vj.transpose(-2, -1)  # (B, K, G, Br, Bc)
                ds = p * (dp - delta[..., i0:i1, None])  # (B, K, G, Br, Bc), d modified scores
                if graph:  # ds becomes d raw scores (unless additive); learned tensors get theirs
                    wrt = [s_raw, *learned] if through_mod else learned
                    grads = torch.autograd.grad(
                        s, wrt, ds, allow_unused=True, materialize_grads=True
                    )
                    if through_mod:
                        ds, *grads = grads
                    for acc_grad, g in zip(d_learned, grads):
                        acc_grad += g
                dq[..., i0:i1, :] += (ds @ kj) * scale
                dk[..., j0:j1, :] += (ds.transpose(-2, -1) @ qi).sum(dim=2) * scale
                if dbias is not None:
                    dbias[..., i0:i1, j0:j1] = ds
        dq = dq.reshape(B, H, T, D).to(q.dtype)
        if dbias is not None:
            dbias = dbias.reshape(B, H, T, S).sum_to_size(bias.shape).to(bias.dtype)
        d_learned = iter(d_learned)
        d_extra = [next(d_learned) if need else None for need in ctx.needs_input_grad[9:]]
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, dbias, None, None, None, None, *d_extra


def _accumulate_dtype(q: Tensor) -> torch.dtype:
    """Scores, sums and outputs are accumulated in fp32, or in q's dtype where wider (fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _keys_seen(i1: int, T: int, S: int, is_causal: bool) -> int:
    """How many leading keys the query rows before i1 may see (all S unless causal)."""
    if not is_causal:
        return S
    return max(0, min(S, i1 + S - T))  # query i sits at position i + S - T


def _block_scores(qi, kg, mask, bias, is_causal, scale, rows, cols, T, S) -> Tensor:
    """Scores of one tile, Q_i K_j^T * scale, with its bias, mask and causal mask applied.

    Args:
        qi: (B, K, G, Br, D) query block.  kg: (B, K, 1, S, D) all keys.
        rows, cols: (i0, i1) query rows and (j0, j1) key columns of the tile.

    Returns:
        (B, K, G, Br, Bc) fp32 scores, -inf where a query may not attend.
    """
    j0, j1 = cols
    s = (qi @ kg[..., j0:j1, :].transpose(-2, -1)) * scale  # (B, K, G, Br, Bc)
    return _modify_scores(s, mask, bias, is_causal, rows, cols, T, S)


def _modify_scores(s, mask, bias, is_causal, rows, cols, T, S) -> Tensor:
    """The bias and the masks of one tile, from tensors or from score_mod / mask_mod functions.

    Args:
        s: (B, K, G, Br, Bc) raw scores Q_i K_j^T * scale of the tile.
        mask: bool tensor broadcastable to (B, H, T, S), or a mask_mod, or None.
        bias: float tensor broadcastable to (B, H, T, S), or a score_mod, or None.
        rows, cols: (i0, i1) query rows and (j0, j1) key columns of the tile.

    Returns:
        (B, K, G, Br, Bc) scores, -inf where a query may not attend.
    """
    (i0, i1), (j0, j1) = rows, cols
    B, Kh, G = s.shape[:3]
    if isinstance(mask, BlockMask):
        mask = mask.mask_mod
    if callable(mask) or callable(bias):  # index tensors that broadcast to (B, K, G, Br, Bc)
        idx = _tile_indices(B, Kh, G, rows, cols, s.device)
    if isinstance(bias, Tensor):
        s = s + _tile(bias, B, Kh, G, T, S, rows, cols).to(s.dtype)
    elif bias is not None:
        s = bias(s, *idx)  # score_mod(score, b, h, i, j)
    if mask is None:
        allowed = None
    elif isinstance(mask, Tensor):
        allowed = _tile(mask, B, Kh, G, T, S, rows, cols)
    else:
        allowed = mask(*idx)  # mask_mod(b, h, i, j), broadcast to the tile
    if is_causal and j1 - 1 > i0 + S - T:  # the tile reaches above the diagonal
        qpos = torch.arange(i0, i1, device=s.device)[:, None] + S - T  # (Br, 1)
        causal = torch.arange(j0, j1, device=s.device)[None, :] <= qpos  # (Br, Bc)
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _live_blocks(mask) -> tuple[Tensor, tuple[int, int]] | None:
    """A BlockMask's (nQ, nKV) map of blocks some query of some row and head may see, or None.

    Returns:
        (live (nQ, nKV) bool, (Q_BLOCK, KV_BLOCK) its block sizes), or None for other masks.
    """
    if not isinstance(mask, BlockMask):
        return None
    live = mask.to_dense().bool().flatten(0, 1).any(dim=0)  # (nQ, nKV): any row b, head h
    return live.cpu(), mask.BLOCK_SIZE


def _tile_is_live(live, rows, cols) -> bool:
    """False when no BlockMask block that the (Br, Bc) tile overlaps is visible."""
    if live is None:
        return True
    (i0, i1), (j0, j1) = rows, cols
    blocks, (bq, bk) = live
    return bool(blocks[i0 // bq : (i1 - 1) // bq + 1, j0 // bk : (j1 - 1) // bk + 1].any())


def _tile_indices(B, Kh, G, rows, cols, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """b, h, i, j of one tile, shaped to broadcast against (B, K, G, Br, Bc).

    Returns:
        b (B, 1, 1, 1, 1), h (1, K, G, 1, 1) the query head k * G + g, i (1, 1, 1, Br, 1) the
        query rows i0..i1-1, j (1, 1, 1, 1, Bc) the key columns j0..j1-1; all int64.
    """
    (i0, i1), (j0, j1) = rows, cols
    b = torch.arange(B, device=device).view(B, 1, 1, 1, 1)
    h = torch.arange(Kh * G, device=device).view(1, Kh, G, 1, 1)
    i = torch.arange(i0, i1, device=device).view(1, 1, 1, -1, 1)
    j = torch.arange(j0, j1, device=device).view(1, 1, 1, 1, -1)
    return b, h, i, j


def _tile(x: Tensor, B, Kh, G, T, S, rows, cols) -> Tensor:
    """One (Br, Bc) tile of a mask or bias broadcastable to (B, H, T, S) -> (B, K, G, Br, Bc)."""
    (i0, i1), (j0, j1) = rows, cols
    tile = x.expand(B, Kh * G, T, S)[:, :, i0:i1, j0:j1]  # a view: nothing (T, S) is built
    return tile.reshape(B, Kh, G, i1 - i0, j1 - j0)
