"""Multi-head attention: MHA, GQA and MQA through `n_kv_heads`; self, causal and cross attention.

    x ──q_proj──> q (B, H, T, D) ─┐
    x ──k_proj──> k (B, K, S, D) ─┼─ ctx.positions.rotate_qk ─> backend(q, k, v, mask, bias) ─> out
    x ──v_proj──> v (B, K, S, D) ─┘      (cross attention: k and v come from `memory`)
                                               out (B, H, T, D) ─concat heads─> o_proj ─> (B, T, C)

n_kv_heads = n_heads is MHA (Vaswani et al. 2017), 1 is MQA (Shazeer 2019), anything between that
divides n_heads is GQA (Ainslie et al. 2023). The model prepares the position scheme's terms once
per forward (`AttentionContext.positions`); Attention applies them (`rotate_qk`, `bias`) without
knowing which scheme made them.

Shapes: B batch, T query length, S key length, C d_model, H query heads, K kv heads, D head_dim.
"""

from functools import partial

import torch
from torch import Tensor, nn

from attnlab.components.backends import BACKENDS, Backend, eager_attention
from attnlab.components.context import NO_CONTEXT, AttentionContext
from attnlab.components.hooks import HookPoint, attend_heads, project_heads
from attnlab.components.kv_cache import KV_CODE_MAX, KVCache, QuantizedKVCache
from attnlab.components.qk_norm import QKNorm, Scope


class Attention(nn.Module):
    """Multi-head scaled dot-product attention with grouped key/value heads.

    Args:
        d_model: width of the input (queries).
        n_heads: number of query heads H.
        n_kv_heads: number of key/value heads K; None -> n_heads (MHA), 1 -> MQA.
        head_dim: per-head width D; None -> d_model // n_heads.
        kv_dim: width of the memory for cross attention; None -> d_model.
        qkv_bias: bias on q/k/v projections.  out_bias: bias on the output projection.
        qk_norm: RMS-normalise q and k before the dot product (components/qk_norm.py).
        qk_norm_scope: "head" (Qwen3, Gemma 3) or "projection", all heads at once (OLMo 2).
        norm_unit_offset: the QK-norms scale by (1 + weight) (Gemma 3).
        softcap: soft-cap the attention logits at this value (Gemma 2, components/softcap.py);
            written out, so it needs backend "eager".
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
        qk_norm_scope: Scope = "head",
        norm_unit_offset: bool = False,
        softcap: float | None = None,
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
        if softcap is not None and backend != "eager":
            raise ValueError(
                f"attention soft-capping (softcap={softcap}) is written out: it needs "
                f"backend='eager', not {backend!r}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale, self.dropout, self.backend, self.cross = scale, dropout, backend, cross
        self.attend = BACKENDS[backend]  # (q, k, v, ...) -> (out, probabilities or None)
        self.softcap = softcap
        if softcap is not None:
            self.attend = partial(eager_attention, softcap=softcap)
        kv_dim = d_model if kv_dim is None else kv_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        norm = partial(QKNorm, head_dim=head_dim, scope=qk_norm_scope, eps=norm_eps)
        self.q_norm = norm(n_heads, unit_offset=norm_unit_offset) if qk_norm else nn.Identity()
        self.k_norm = norm(n_kv_heads, unit_offset=norm_unit_offset) if qk_norm else nn.Identity()
        self.hook_in = HookPoint()  # (B, T, C) what q, k and v are projected from
        self.hook_q_proj, self.hook_k_proj = HookPoint(), HookPoint()  # (B, T, H|K, D) unrotated
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_scores, self.hook_pattern = HookPoint(), HookPoint()  # seen only when hooked
        self.hook_z, self.hook_result = HookPoint(), HookPoint()  # result: built only when hooked
        self.hook_out = HookPoint()

    def forward(self, x: Tensor, ctx: AttentionContext = NO_CONTEXT, cache=None) -> Tensor:
        """Attend from `x` to itself (or to `ctx.memory` for cross attention).

        Args:
            x: (B, T, C) queries' input.
            ctx: the forward's AttentionContext (components/context.py). Self-attention reads
                its mask, is_causal, positions and slots; cross attention its memory and
                memory_mask.
            cache: self-attention: a LayerCache (a KVCache, or a paged cache's layer view)
                written at `ctx.slots`; cross-attention: a CrossKV that keeps the memory's keys
                and values after the first call.

        Returns:
            (B, T, C). Each activation passes a hook point (components/hooks.py).
        """
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        x = self.hook_in(x)
        q = self.hook_q_proj(self.q_norm(self.q_proj(x).view(B, T, H, D)))  # (B, T, H, D)
        q = q.transpose(1, 2)  # (B, H, T, D)
        if self.cross:
            mask, bias, is_causal = ctx.memory_mask, None, False
            if cache is None:
                k, v = self.project_kv(ctx.memory)  # (B, K, M, D)
            else:
                k, v = cache.get(lambda: self.project_kv(ctx.memory))  # computed once per source
            cache = None  # nothing more to write
        else:
            mask, bias, is_causal = ctx.mask, ctx.positions.bias, ctx.is_causal
            k, v = self.project_kv(x)  # (B, K, T, D)
            q, k = ctx.positions.rotate_qk(q, k)  # the new keys sit at the queries' positions
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if cache is None:
            z = attend_heads(self, q, k, v, mask, bias, is_causal)  # (B, H, T, D)
        else:  # the cache writes the new keys, then attends to all it holds (kv_cache.py)
            z = cache.attend(q, k, v, ctx.slots, mask, bias, self.attend_to, self.scale)
        z = self.hook_z(z)  # (B, H, T, D): each head's output
        return self.hook_out(project_heads(self, z))  # (B, T, C): o_proj on the heads' concat

    def attend_to(self, q, k, v, mask=None, bias=None) -> Tensor:
        """This layer's attention of q (B, H, T, D) to cached k, v (B, K, S, D) -> (B, H, T, D)."""
        return attend_heads(self, q, k, v, mask, bias)

    def project_kv(self, source: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values of `source` (B, S, C_kv) -> each (B, K, S, D)."""
        if source is None:
            raise ValueError("cross attention needs the encoder memory (memory=None was given)")
        B, S, _ = source.shape
        K, D = self.n_kv_heads, self.head_dim
        k = self.hook_k_proj(self.k_norm(self.k_proj(source).view(B, S, K, D)))  # (B, S, K, D)
        k = k.transpose(1, 2)  # (B, K, S, D)
        v = self.v_proj(source).view(B, S, K, D).transpose(1, 2)  # (B, K, S, D)
        return k, v

    def make_cache(self, B: int, S_max: int, dtype: torch.dtype, device=None):
        """A `KVCache` for this layer's self-attention: (B, K, S_max, D) keys and values (a
        `QuantizedKVCache` for dtype torch.int8 or torch.float8_e4m3fn)."""
        if dtype in KV_CODE_MAX:
            return QuantizedKVCache(B, self.n_kv_heads, S_max, self.head_dim, dtype, device)
        return KVCache(B, self.n_kv_heads, S_max, self.head_dim, dtype, device)
