"""Multi-head attention: MHA, GQA and MQA through `n_kv_heads`; self, causal and cross attention.

    x ──q_proj──> q (B, H, T, D) ─┐
    x ──k_proj──> k (B, K, S, D) ─┼─ ctx.positions.rotate_qk ─> backend(q, k, v, mask, bias) ─> out
    x ──v_proj──> v (B, K, S, D) ─┘      (cross attention: k and v come from `memory`)

n_kv_heads = n_heads is MHA (Vaswani et al. 2017), 1 is MQA (Shazeer 2019), anything between that
divides n_heads is GQA (Ainslie et al. 2023). The model prepares the position scheme's terms once
per forward (`AttentionContext.positions`); Attention applies them (`rotate_qk`, `bias`) without
knowing which scheme made them.

Shapes: B batch, T query length, S key length, C d_model, H query heads, K kv heads, D head_dim.
"""

import torch
from torch import Tensor, nn

from attnlab.components.backends import BACKENDS, Backend
from attnlab.components.context import NO_CONTEXT, AttentionContext
from attnlab.components.flex import dense_terms
from attnlab.components.kv_cache import KVCache
from attnlab.components.masks import check_mask
from attnlab.components.norms import RMSNorm


class Attention(nn.Module):
    """Multi-head scaled dot-product attention with grouped key/value heads.

    Args:
        d_model: width of the input (queries).
        n_heads: number of query heads H.
        n_kv_heads: number of key/value heads K; None -> n_heads (MHA), 1 -> MQA.
        head_dim: per-head width D; None -> d_model // n_heads.
        kv_dim: width of the memory for cross attention; None -> d_model.
        qkv_bias: bias on q/k/v projections.  out_bias: bias on the output projection.
        qk_norm: RMS-normalise q and k per head before the dot product (Dehghani et al. 2023).
        dropout: dropout on the attention probabilities (training only).
        scale: score scale; None -> 1 / sqrt(D) (T5 uses 1.0).
        backend: "sdpa" (fused kernels), "eager" (written out, can return probabilities) or
            "flash" (FlashAttention-2 written out; probabilities recomputed from its saved L),
            "flex" (bias and mask as functions), "triton", or "auto" (flex for a call whose
            bias or mask is a function, sdpa otherwise; components/backends.py).
        cross: this layer attends to encoder memory instead of its own input.
        norm_eps: epsilon of the QK-norm.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        backend: Backend = "sdpa",
        cross: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                    "pick another n_heads or set head_dim"
                )
            head_dim = d_model // n_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose from {list(BACKENDS)}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale, self.dropout, self.backend, self.cross = scale, dropout, backend, cross
        self.attend = BACKENDS[backend]  # (q, k, v, ...) -> (out, probabilities or None)
        kv_dim = d_model if kv_dim is None else kv_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.capture_weights = False  # set to keep the probabilities (B, H, T, S) in .weights
        self.weights: Tensor | None = None
        # (H,) gate on each head's output before o_proj (Michel et al. 2019); None = no gate.
        # A plain attribute, not a buffer: an experiment's setting, never saved with the weights.
        self.head_mask: Tensor | None = None

    def forward(self, x: Tensor, ctx: AttentionContext = NO_CONTEXT, cache=None) -> Tensor:
        """Attend from `x` to itself (or to `ctx.memory` for cross attention).

        Args:
            x: (B, T, C) queries' input.
            ctx: the forward's AttentionContext (components/context.py). Self-attention reads
                its mask, is_causal, positions and slots; cross attention its memory and
                memory_mask.
            cache: self-attention: a KVCache (or a paged cache's layer view) written at
                `ctx.slots`; cross-attention: a CrossKV that keeps the memory's keys and values
                after the first call.

        Returns:
            (B, T, C). With `capture_weights` set, the probabilities are left in `self.weights`.
            With `head_mask` set, head h's output is multiplied by head_mask[h] before o_proj.
        """
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, H, D).transpose(1, 2))  # (B, H, T, D)
        if self.cross:
            mask, bias, is_causal = ctx.memory_mask, None, False
            if cache is None:
                k, v = self.project_kv(ctx.memory)  # (B, K, M, D)
            else:
                k, v = cache.get(lambda: self.project_kv(ctx.memory))  # computed once per source
        else:
            mask, bias, is_causal = ctx.mask, ctx.positions.bias, ctx.is_causal
            k, v = self.project_kv(x)  # (B, K, T, D)
            q, k = ctx.positions.rotate_qk(q, k)  # the new keys sit at the queries' positions
            if getattr(cache, "attend_rows", None) and not self.capture_weights:
                # A paged cache's rows have their own lengths: it writes the new keys, then has
                # each group of rows of similar length attend to keys gathered only as far as
                # its longest row (components/paged_kv_cache.py).
                def attend_rows(q, k, v, mask, bias):  # one group's (b, H, T, D)
                    return self.attend(q, k, v, mask=mask, bias=bias, scale=self.scale)[0]

                out = cache.attend_rows(q, k, v, ctx.slots, mask, bias, attend_rows, self.scale)
                return self.output(out)
            if cache is not None:
                k, v = cache.update(k, v, ctx.slots)  # (B, K, S_max, D)
        if mask is not None:
            check_mask(mask, B, H, T, k.shape[2])
        args = dict(mask=mask, bias=bias, is_causal=is_causal, scale=self.scale)
        dropout = self.dropout if self.training else 0.0
        # The flash backend recomputes the probabilities from its saved log-sum-exp.
        from_flash = self.capture_weights and self.backend == "flash"
        out, weights = self.attend(q, k, v, dropout=dropout, return_weights=from_flash, **args)
        if self.capture_weights and weights is None:
            # Recomputed on the eager path, so the output above stays on the fast path (a flex
            # layer's mask_mod / score_mod become the dense tensors eager takes).
            args["mask"], args["bias"] = dense_terms(mask, args["bias"], B, H, T, k.shape[2])
            weights = BACKENDS["eager"](q, k, v, return_weights=True, **args)[1]
        if self.capture_weights:
            self.weights = weights  # (B, H, T, S)
        return self.output(out)

    def output(self, out: Tensor) -> Tensor:
        """The heads' outputs (B, H, T, D) -> (B, T, C): gated by `head_mask`, concatenated,
        projected by o_proj."""
        B, H, T, D = out.shape
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype).view(1, H, 1, 1)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.o_proj(out)  # (B, T, C)

    def project_kv(self, source: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values of `source` (B, S, C_kv) -> each (B, K, S, D)."""
        if source is None:
            raise ValueError("cross attention needs the encoder memory (memory=None was given)")
        B, S, _ = source.shape
        K, D = self.n_kv_heads, self.head_dim
        k = self.k_norm(self.k_proj(source).view(B, S, K, D).transpose(1, 2))  # (B, K, S, D)
        v = self.v_proj(source).view(B, S, K, D).transpose(1, 2)  # (B, K, S, D)
        return k, v

    def make_cache(self, B: int, S_max: int, dtype: torch.dtype, device=None):
        """A `KVCache` for this layer's self-attention: (B, K, S_max, D) keys and values."""
        return KVCache(B, self.n_kv_heads, S_max, self.head_dim, dtype, device)
