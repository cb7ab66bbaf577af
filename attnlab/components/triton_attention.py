"""FlashAttention-2 as a Triton kernel, forward and backward: backend "triton".

The same algorithm as the PyTorch version in `components/flash.py`, written as GPU kernels
(Dao 2023, "FlashAttention-2", algorithms 1 and 2). The names map one to one:

    flash.py (PyTorch)        here (Triton)          meaning
    ──────────────────        ─────────────          ───────
    Q block  (Br, D)          q    (BLOCK_M, D)      one program's query rows
    K, V blocks (Bc, D)       k, v (BLOCK_N, D)      the key/value block of one loop step
    S = Q K^T * scale         s                      scores of the block (base 2, see below)
    m  (running max)          m_i                    the largest score seen so far, per row
    l  (running sum)          l_i                    sum of exp(score - m) so far, per row
    O  (unnormalised)         acc                    sum of exp(score - m) V so far, per row
    L = m + log l             lse                    log-sum-exp, saved for the backward pass
    D = rowsum(dO * O)        delta                  the backward pass's correction term

Forward (one program per query block and (batch, head)): for each key block, s = q k^T,
m_new = max(m_i, rowmax(s)), p = exp(s - m_new), acc = acc * exp(m_i - m_new) + p v,
l_i = l_i * exp(m_i - m_new) + rowsum(p); at the end O = acc / l_i and L = m_i + log l_i. No
(T, S) tensor exists anywhere: only one (BLOCK_M, BLOCK_N) tile at a time, in registers.

Backward (recompute from L instead of storing the probabilities): P = exp(S - L),
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dK = dS^T Q * scale, dQ = dS K * scale. One
kernel walks key blocks and accumulates dK, dV (looping over the query blocks and over the G
query heads sharing that kv head, so GQA needs neither atomics nor a repeated K/V); a second walks
query blocks and accumulates dQ.

Details:
    - Scores are kept in base 2 (scale * log2(e) folded into s; exp2 instead of exp), as in the
      Triton tutorial's kernel: the same softmax, one multiply cheaper. `lse` is stored in base 2.
    - Causal: query i (of the last T of S positions) may see key j when j <= i + S - T. Key
      blocks wholly above that diagonal are never loaded (the loop stops early); the diagonal
      blocks are masked element by element.
    - GQA: query head h reads kv head h // G by pointer arithmetic; K and V are never repeated.
    - Masks: a key-padding mask (broadcastable to (B, 1, 1, S)) is supported; any other mask, a
      float bias, dropout or returning the weights raise a ValueError pointing to a backend that
      supports them. A query row that may attend to nothing gives zeros (eager's convention).
    - Head dims 16-128 (padded inside the kernel to a power of two); fp32, bf16 and fp16 in,
      fp32 accumulation. fp32 products use IEEE precision (no TF32), so fp32 results match SDPA.

On CPU the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1` set before triton
is imported): that is how the tests check them. `benchmarks/gpu_check.py` times forward +
backward against SDPA's flash kernel on a CUDA GPU (bf16, causal, T = 4k-16k) and reports the
kernel's throughput as a fraction of SDPA's (target >= 70%).

Shapes: B batch, H query heads, K kv heads, G = H // K, T queries, S keys, D head_dim.
"""

import os
from functools import cache

import torch
from torch import Tensor

BLOCK_M, BLOCK_N = 64, 64  # query rows and key columns of one tile
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _kernels():
    """Import triton and define the three kernels (once): the package imports without triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(
            "the triton attention backend needs triton: pip install 'attnlab[triton]', "
            "or choose backend='sdpa'"
        ) from e

    @triton.jit
    def fwd_kernel(
        Q, K, V, O, LSE, KPM,  # (B,H,T,D) (B,K,S,D) (B,K,S,D) (B,H,T,D) (B,H,T) (B,S) int8
        qk_scale, H, G, T, S, D,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1).to(tl.int64)  # b * H + h
        b, h = bh // H, bh % H
        bk = b * (H // G) + h // G  # the kv head this query head reads (GQA)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        d_ok = offs_d < D
        q_ptrs = Q + (bh * T + offs_m[:, None]) * D + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = S
        if CAUSAL:  # keys beyond the last query's diagonal are never loaded
            hi = tl.minimum(S, start_m + BLOCK_M + S - T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            kv_ok = (cols < S)[:, None] & d_ok[None, :]
            kv_off = (bk * S + cols[:, None]) * D + offs_d[None, :]
            k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
            v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale  # (BLOCK_M, BLOCK_N), base 2
            ok = (cols < S)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None] + S - T)
            if HAS_KPM:
                kpm = tl.load(KPM + b * S + cols, mask=cols < S, other=0)
                ok = ok & (kpm != 0)[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        empty = l_i == 0.0  # the row may attend to nothing: zeros out, no gradient
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        o_ptrs = O + (bh * T + offs_m[:, None]) * D + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + bh * T + offs_m, lse, mask=row_ok)

    @triton.jit
    def bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, KPM,
        qk_scale, sm_scale, H, G, T, S, D,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        start_n = tl.program_id(0) * BLOCK_N
        bk = tl.program_id(1).to(tl.int64)  # b * K + kv head
        KH = H // G
        b, kh = bk // KH, bk % KH
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        col_ok = offs_n < S
        d_ok = offs_d < D
        kv_off = (bk * S + offs_n[:, None]) * D + offs_d[None, :]
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        key_ok = col_ok
        if HAS_KPM:
            kpm = tl.load(KPM + b * S + offs_n, mask=col_ok, other=0)
            key_ok = key_ok & (kpm != 0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = 0
        if CAUSAL:  # query blocks wholly before this key block's diagonal are skipped
            lo = tl.maximum(0, start_n - (S - T))
            lo = (lo // BLOCK_M) * BLOCK_M
        for g in range(0, G):  # the G query heads sharing this kv head
            bh = b * H + kh * G + g
            for start_m in range(lo, T, BLOCK_M):
                offs_m = start_m + offs_m0
                row_ok = offs_m < T
                qo_off = (bh * T + offs_m[:, None]) * D + offs_d[None, :]
                qo_ok = row_ok[:, None] & d_ok[None, :]
                q = tl.load(Q + qo_off, mask=qo_ok, other=0.0)
                do = tl.load(DO + qo_off, mask=qo_ok, other=0.0)
                lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                ok = row_ok[:, None] & key_ok[None, :]
                if CAUSAL:
                    ok = ok & (offs_n[None, :] <= offs_m[:, None] + S - T)
                p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N)
                if IEEE:
                    dv += tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
                    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                else:
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                    dp = tl.dot(do, tl.trans(v))
                ds = p * (dp - delta[:, None])
                if IEEE:
                    dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
                else:
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_ok)

    @triton.jit
    def bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, KPM,
        qk_scale, sm_scale, H, G, T, S, D,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh // H, bh % H
        bk = b * (H // G) + h // G
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        d_ok = offs_d < D
        qo_off = (bh * T + offs_m[:, None]) * D + offs_d[None, :]
        qo_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + qo_off, mask=qo_ok, other=0.0)
        do = tl.load(DO + qo_off, mask=qo_ok, other=0.0)
        lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = S
        if CAUSAL:
            hi = tl.minimum(S, start_m + BLOCK_M + S - T)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            col_ok = offs_n < S
            kv_off = (bk * S + offs_n[:, None]) * D + offs_d[None, :]
            kv_ok = col_ok[:, None] & d_ok[None, :]
            k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
            v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
            ok = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + S - T)
            if HAS_KPM:
                kpm = tl.load(KPM + b * S + offs_n, mask=col_ok, other=0)
                ok = ok & (kpm != 0)[None, :]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(v))
            p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if IEEE:
                dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + qo_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qo_ok)

    return triton, fwd_kernel, bwd_dkdv_kernel, bwd_dq_kernel


def _block_d(D: int) -> int:
    """The head dim padded to a power of two (tl.arange needs one), at least 16 (tl.dot's)."""
    return max(16, 1 << (D - 1).bit_length())


def _forward(q, k, v, kpm, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Returns O (B, H, T, D) and the base-2 log-sum-exp (B, H, T)."""
    triton, fwd, _, _ = _kernels()
    B, H, T, D = q.shape
    G, S = H // k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BLOCK_M), B * H)
    fwd[grid](
        q, k, v, o, lse, kpm if kpm is not None else q,
        scale * LOG2E, H, G, T, S, D,
        CAUSAL=causal, HAS_KPM=kpm is not None, IEEE=q.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=_block_d(D),
    )  # fmt: skip
    return o, lse


def _backward(q, k, v, o, lse, do, kpm, causal: bool, scale: float):
    """Launch the two backward kernels. Returns dQ, dK, dV in the inputs' shapes and dtypes."""
    triton, _, bwd_dkdv, bwd_dq = _kernels()
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    delta = (do.float() * o.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(
        CAUSAL=causal, HAS_KPM=kpm is not None, IEEE=q.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=_block_d(D),
    )  # fmt: skip
    kpm_arg = kpm if kpm is not None else q
    bwd_dkdv[(triton.cdiv(S, BLOCK_N), B * K)](
        q, k, v, do, lse, delta, dk, dv, kpm_arg,
        scale * LOG2E, scale, H, G, T, S, D, **common,
    )  # fmt: skip
    bwd_dq[(triton.cdiv(T, BLOCK_M), B * H)](
        q, k, v, do, lse, delta, dq, kpm_arg,
        scale * LOG2E, scale, H, G, T, S, D, **common,
    )  # fmt: skip
    return dq, dk, dv


class TritonFlashAttention(torch.autograd.Function):
    """softmax(Q K^T * scale, masked) V by the Triton kernels; the backward recomputes from L."""

    @staticmethod
    def forward(ctx, q, k, v, kpm, causal, scale):
        """q: (B, H, T, D); k, v: (B, K, S, D); kpm: (B, S) int8 or None. Returns (B, H, T, D)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _forward(q, k, v, kpm, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse, kpm)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, kpm = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do.contiguous(), kpm, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def _key_padding(mask: Tensor | None, B: int, S: int) -> Tensor | None:
    """A bool mask broadcastable to (B, 1, 1, S) as a (B, S) int8 tensor; anything else refused."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(
            f"the triton backend takes only a key-padding mask of shape (B, 1, 1, S), got "
            f"{tuple(mask.shape)}; use backend='sdpa' or 'eager' for other masks"
        )
    return mask.expand(B, 1, 1, S).reshape(B, S).to(torch.int8).contiguous()


def triton_attention(
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
    """FlashAttention-2 through the Triton kernels, with `eager_attention`'s arguments.

    Args:
        q: (B, H, T, D) queries.  k, v: (B, K, S, D) keys and values, K divides H; D in 16-128.
        mask: None, or a bool key-padding mask broadcastable to (B, 1, 1, S), True = may attend.
        bias: must be None (a float score bias is not supported here).
        is_causal: causal mask, the T queries being the last T of S positions.
        scale: score scale; None -> 1 / sqrt(D).
        dropout: must be 0.
        return_weights: must be False.

    Returns:
        out: (B, H, T, D) in q's dtype; None.
    """
    unsupported = {
        "bias": bias is not None,
        "dropout": dropout > 0,
        "return_weights": return_weights,
    }
    for name, asked in unsupported.items():
        if asked:
            raise ValueError(
                f"the triton backend does not support {name}; use backend='eager' or 'sdpa'"
            )
    B, H, T, D = q.shape
    if not 16 <= D <= 128:
        raise ValueError(f"the triton backend takes head_dim 16-128, got {D}; use backend='sdpa'")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the triton backend takes fp32/bf16/fp16, got {q.dtype}")
    if H % k.shape[1] != 0:
        raise ValueError(f"{k.shape[1]} kv heads do not divide {H} query heads")
    kpm = _key_padding(mask, B, k.shape[2])
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"the triton backend needs a CUDA device, got {q.device.type!r} tensors; use "
            "backend='sdpa' on CPU (or set TRITON_INTERPRET=1 before importing triton to "
            "run the kernels slowly through the interpreter)"
        )
    scale = D**-0.5 if scale is None else float(scale)
    return TritonFlashAttention.apply(q, k, v, kpm, bool(is_causal), scale), None
