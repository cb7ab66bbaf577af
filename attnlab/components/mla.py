"""Multi-head Latent Attention, MLA (DeepSeek-V2, arXiv:2405.04434 §2.1; DeepSeek-V3).

Keys and values are squeezed through one low-rank latent per token, and the cache keeps only
that latent plus one small rotary key shared by all heads:

    x ──kv_a_proj──> [c_kv (r) | k_pe (R)] ── c_kv: kv_a_norm ─┐            cached per token:
                                           └─ k_pe: RoPE ─────┤            r + R numbers
    c_kv ──kv_b_proj──> per head [k_nope (Dn) | v (Dv)]        │
    x ──q_proj (or q_a_proj -> q_a_norm -> q_b_proj)──> per head [q_nope (Dn) | q_pe (R)]
    score_h = (q_nope_h . k_nope_h + RoPE(q_pe_h) . RoPE(k_pe)) * (Dn + R)^-0.5

RoPE cannot live inside the latent: a rotation between W_UK and the query would stop the up
projection from being folded away. So position is "decoupled" into the small R-wide rope part
(one key per token, like MQA) beside the position-free Dn-wide part (eq. 14-19 of the paper).

Two ways to compute the same thing (`absorb`):

    plain     expand the latent into per-head keys and values, then ordinary attention.
    absorbed  fold W_UK into the query and W_UV into the output (eq. 10-11's observation):
              q_lat_h = q_nope_h W_UK_h  (B, H, T, r);  scores read the latent directly, so the
              whole layer is MQA with one kv "head" [c_kv | k_pe] of width r + R whose values are
              c_kv itself; out_h = (P_h c_kv) W_UV_h^T. Cheaper to decode (nothing per head is
              materialised for the S cached tokens), dearer to train.

The forward's prepared position terms are applied as in `Attention`, with `rotate_qk` seeing
only the rope parts (the scheme must be built for head_dim = R) and the bias added to the scores.

Shapes: B batch, T queries, S keys, C d_model, H heads, r kv_lora_rank, r_q q_lora_rank,
Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim.
"""

import torch
from torch import Tensor, nn

from attnlab.components.backends import BACKENDS, Backend
from attnlab.components.context import NO_CONTEXT, AttentionContext
from attnlab.components.hooks import HookPoint, attend_heads
from attnlab.components.kv_cache import LatentCache
from attnlab.components.norms import RMSNorm


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's MLA: low-rank joint KV compression with a decoupled, shared RoPE key.

    Self-attention only (causal or not); drops into `DecoderBlock` / `EncoderBlock` where an
    `Attention` would go, with the same forward signature.

    Args:
        d_model: C.  n_heads: H.
        kv_lora_rank: r, width of the cached latent c_kv.
        qk_rope_head_dim: R, the rotary part of each query and of the one shared key.
        qk_nope_head_dim: Dn, the position-free part of each query/key head.
        v_head_dim: Dv, per-head value width.
        q_lora_rank: r_q, compress queries through their own latent too; None = one q_proj.
        out_bias: bias on o_proj.  dropout: on the attention probabilities (training only).
        scale: score scale; None -> (Dn + R)^-0.5.
        backend: "sdpa" or "eager".
        absorb: compute with W_UK / W_UV folded into query and output (same numbers).
        norm_eps: epsilon of the latents' RMSNorms.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        out_bias: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        backend: Backend = "sdpa",
        absorb: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose from {list(BACKENDS)}")
        H, r, R, Dn, Dv = n_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
        self.n_heads, self.kv_lora_rank, self.q_lora_rank = H, r, q_lora_rank
        self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim = R, Dn, Dv
        self.scale = (Dn + R) ** -0.5 if scale is None else scale  # explicit: absorb changes D
        self.dropout, self.backend, self.absorb = dropout, backend, absorb
        self.attend = BACKENDS[backend]  # (q, k, v, ...) -> (out, probabilities or None)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * (Dn + R), bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * (Dn + R), bias=False)
        self.kv_a_proj = nn.Linear(d_model, r + R, bias=False)  # W_DKV and W_KR side by side
        self.kv_a_norm = RMSNorm(r, norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (Dn + Dv), bias=False)  # W_UK and W_UV, per head
        self.o_proj = nn.Linear(H * Dv, d_model, bias=out_bias)
        # Hook points as Attention's (components/hooks.py); q, k, v in the form attended:
        # plain (B, H, *, Dn + R) / (B, H, S, Dv), or absorbed against the latent.
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z, self.hook_out = HookPoint(), HookPoint()

    def forward(self, x: Tensor, ctx: AttentionContext = NO_CONTEXT, cache=None) -> Tensor:
        """Attend from `x` to itself; arguments as `Attention.forward` (no cross attention).

        Args:
            x: (B, T, C).
            ctx: the forward's AttentionContext; its position terms rotate the (.., R) rope
                parts only, and `ctx.memory` must be None (MLA is self-attention).
            cache: a `LatentCache` written at `ctx.slots` (T,).

        Returns:
            (B, T, C). Each activation passes a hook point (components/hooks.py).
        """
        if ctx.memory is not None:
            raise ValueError("MultiHeadLatentAttention is self-attention only (memory was given)")
        B, T, _ = x.shape
        H, Dn, R, r = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q = self.project_q(x).view(B, T, H, Dn + R).transpose(1, 2)  # (B, H, T, Dn + R)
        q_nope, q_pe = q.split([Dn, R], dim=-1)  # (B, H, T, Dn), (B, H, T, R)
        c_kv, k_pe = self.kv_a_proj(x).split([r, R], dim=-1)  # (B, T, r), (B, T, R)
        c_kv = self.kv_a_norm(c_kv)
        q_pe, k_pe = ctx.positions.rotate_qk(q_pe, k_pe[:, None])  # k_pe (B, 1, T, R)
        k_pe = k_pe[:, 0]  # (B, T, R): one rope key per token, shared by every head
        if cache is not None:
            c_kv, k_pe = cache.update(c_kv, k_pe, ctx.slots)  # (B, S_max, r), (B, S_max, R)
        q, k, v = (self.absorbed_qkv if self.absorb else self.plain_qkv)(q_nope, q_pe, c_kv, k_pe)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        out = attend_heads(self, q, k, v, ctx.mask, ctx.positions.bias, ctx.is_causal)
        if self.absorb:
            out = torch.einsum("bhtr,hdr->bhtd", out, self._up_weights()[1])  # (B, H, T, Dv)
        z = self.hook_z(out)  # (B, H, T, Dv): each head's output
        out = self.o_proj(z.transpose(1, 2).reshape(B, T, H * self.v_head_dim))  # (B, T, C)
        return self.hook_out(out)

    def project_q(self, x: Tensor) -> Tensor:
        """Queries of x (B, T, C) -> (B, T, H * (Dn + R)), through the q latent if there is one."""
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def plain_qkv(self, q_nope, q_pe, c_kv, k_pe) -> tuple[Tensor, Tensor, Tensor]:
        """Expand the latent into H ordinary key/value heads (what training computes).

        Args: q_nope (B, H, T, Dn), q_pe (B, H, T, R), c_kv (B, S, r), k_pe (B, S, R).
        Returns: q (B, H, T, Dn + R), k (B, H, S, Dn + R), v (B, H, S, Dv).
        """
        B, S, _ = c_kv.shape
        H, Dn, Dv = self.n_heads, self.qk_nope_head_dim, self.v_head_dim
        kv = self.kv_b_proj(c_kv).view(B, S, H, Dn + Dv).transpose(1, 2)  # (B, H, S, Dn + Dv)
        k_nope, v = kv.split([Dn, Dv], dim=-1)  # (B, H, S, Dn), (B, H, S, Dv)
        k_pe = k_pe[:, None].expand(B, H, S, self.qk_rope_head_dim)  # (B, H, S, R), a view
        return torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1), v

    def absorbed_qkv(self, q_nope, q_pe, c_kv, k_pe) -> tuple[Tensor, Tensor, Tensor]:
        """Fold W_UK into the query: scores against the latent itself, MQA with one kv head.

            q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c      for every cached latent c

        Args: as `plain_qkv`.
        Returns: q (B, H, T, r + R), k (B, 1, S, r + R), v (B, 1, S, r); the caller applies
            W_UV to the (B, H, T, r) output.
        """
        w_uk, _ = self._up_weights()  # (H, Dn, r)
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, r)
        q = torch.cat((q_lat, q_pe), dim=-1)  # (B, H, T, r + R)
        k = torch.cat((c_kv, k_pe), dim=-1)[:, None]  # (B, 1, S, r + R)
        return q, k, c_kv[:, None]  # v: (B, 1, S, r)

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight split per head: W_UK (H, Dn, r) and W_UV (H, Dv, r)."""
        H, Dn, Dv = self.n_heads, self.qk_nope_head_dim, self.v_head_dim
        w = self.kv_b_proj.weight.view(H, Dn + Dv, self.kv_lora_rank)  # (H, Dn + Dv, r)
        return w[:, :Dn], w[:, Dn:]

    def make_cache(self, B: int, S_max: int, dtype: torch.dtype, device=None):
        """A `LatentCache` for this layer: c_kv (B, S_max, r) and k_pe (B, S_max, R) only."""
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise ValueError(
                f"an MLA layer's latent cache is kept in float, not {dtype}: a quantized KV "
                "cache holds the keys and values of standard attention"
            )
        return LatentCache(B, S_max, self.kv_lora_rank, self.qk_rope_head_dim, dtype, device)
