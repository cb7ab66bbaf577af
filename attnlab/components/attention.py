"""Multi-head attention: MHA, GQA and MQA through `n_kv_heads`; self, causal and cross attention.

    x ──q_proj──> q (B, H, T, D) ─┐
    x ──k_proj──> k (B, K, S, D) ─┼─ positions.rotate_qk ─> backend(q, k, v, mask, bias) ─> o_proj
    x ──v_proj──> v (B, K, S, D) ─┘      (cross attention: k and v come from `memory`)

n_kv_heads = n_heads is MHA (Vaswani et al. 2017), 1 is MQA (Shazeer 2019), anything between that
divides n_heads is GQA (Ainslie et al. 2023). The position scheme is passed in, and Attention calls
its hooks (`rotate_qk`, `score_bias`) without knowing which scheme it is.

Shapes: B batch, T query length, S key length, C d_model, H query heads, K kv heads, D head_dim.
"""

import torch
from torch import Tensor, nn

from attnlab.components.backends import BACKENDS, Backend
from attnlab.components.kv_cache import KVCache
from attnlab.components.masks import check_mask
from attnlab.components.norms import RMSNorm
from attnlab.components.positions.base import NoPosition, PositionScheme

_NO_POSITION = NoPosition()


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
        backend: "sdpa" (fused kernels) or "eager" (written out, can return probabilities).
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
        kv_dim = d_model if kv_dim is None else kv_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.capture_weights = False  # set to keep the probabilities (B, H, T, S) in .weights
        self.weights: Tensor | None = None

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        memory: Tensor | None = None,
        positions: PositionScheme | None = None,
        q_pos: Tensor | None = None,
        k_pos: Tensor | None = None,
        cache=None,
        slots: Tensor | None = None,
    ) -> Tensor:
        """Attend from `x` to itself (or to `memory` for cross attention).

        Args:
            x: (B, T, C) queries' input.
            mask: bool, broadcastable to (B, H, T, S), True = may attend.
            is_causal: add a causal mask (cheaper than passing one: SDPA's flash path).
            memory: (B, S, C_kv) encoder output; required for cross attention.
            positions: the model's position scheme (its rotate_qk and score_bias hooks).
            q_pos: (T,) or (B, T) positions of the queries; default 0..T-1.
            k_pos: (S,) or (B, S) positions of every cache slot (with a self-attention cache);
                without a cache the keys are the queries, so k_pos = q_pos.
            cache: self-attention: a KVCache written at `slots`; cross-attention: a CrossKV
                that keeps the memory's keys and values after the first call.
            slots: (T,) cache slots of the new tokens.

        Returns:
            (B, T, C). With `capture_weights` set, the probabilities are left in `self.weights`.
        """
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        positions = _NO_POSITION if positions is None else positions
        q = self.q_norm(self.q_proj(x).view(B, T, H, D).transpose(1, 2))  # (B, H, T, D)
        q_pos = torch.arange(T, device=x.device) if q_pos is None else q_pos
        bias = None
        if self.cross:
            if cache is None:
                k, v = self.project_kv(memory)  # (B, K, M, D)
            else:
                k, v = cache.get(lambda: self.project_kv(memory))  # computed once per source
        else:
            k, v = self.project_kv(x)  # (B, K, T, D)
            q, k = positions.rotate_qk(q, k, q_pos, q_pos)
            if cache is None:
                k_pos = q_pos
            else:
                k, v = cache.update(k, v, slots)  # (B, K, S_max, D)
            bias = positions.score_bias(q_pos, k_pos)  # (H, T, S), (B, H, T, S) or None
        if mask is not None:
            check_mask(mask, B, H, T, k.shape[2])
        args = dict(mask=mask, bias=bias, is_causal=is_causal, scale=self.scale)
        dropout = self.dropout if self.training else 0.0
        backend = "eager" if _written_out_is_faster(q, k) else self.backend
        out, _ = BACKENDS[backend](q, k, v, dropout=dropout, **args)  # (B, H, T, D)
        if self.capture_weights:
            # Recomputed on the eager path, so the output above stays on the fast path.
            self.weights = BACKENDS["eager"](q, k, v, return_weights=True, **args)[1]
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


SHORT_KEYS_CPU = 64  # inside torch.compile on CPU, attend to at most this many keys written out


def _written_out_is_faster(q: Tensor, k: Tensor) -> bool:
    """Whether, inside torch.compile, the written-out attention beats SDPA's kernel.

    Written out, inductor fuses the scale, mask and softmax (forward and backward) with their
    neighbours and leaves two batched matmuls; SDPA stays one opaque kernel call. That wins for
    one query (a compiled decode step), and on CPU for short sequences: forward + backward,
    causal, (12, 4, 64, 32): 1.9 against 2.8 ms; (4, 12, 64, 64): 3.6 against 4.0; about equal
    at 128 keys; at 256 and beyond SDPA's flash kernel (which skips the masked half) wins.

    Args:
        q: (B, H, T, D).  k: (B, K, S, D).
    """
    if not torch.compiler.is_compiling():
        return False
    return q.shape[2] == 1 or (q.device.type == "cpu" and k.shape[2] <= SHORT_KEYS_CPU)
