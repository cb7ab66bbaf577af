"""KV caches: keys and values of past tokens, kept so each new token costs one column, not a
recomputation of the whole prefix.

    slots:   0   1   2   3   4   5   6   7        (S_max preallocated; written at `slots`)
    row 0:  pad pad  a   b   c   d   .   .        left padding: position = slot - 2
    row 1:   w   x   y   z   u   v   .   .        position = slot

Buffers are allocated once, shaped (B, K, S_max, D) (K kv heads: GQA/MQA caches only K), and
written in place with `index_copy_`, so the decode step has static shapes and can be compiled.
Attention always reads the whole buffer; the mask hides padding and not-yet-written slots.

Cross-attention (encoder-decoder) keys and values depend only on the source, so `CrossKV`
computes them on the first call and hands them back on every later one.

Multi-head Latent Attention (components/mla.py) keeps a `LatentCache` instead: per token only the
compressed latent c_kv (r numbers) and the one rope key shared by all heads (R numbers), not H
heads of keys and values. Each attention layer builds its own cache (`make_cache`), so
`ModelCache` never asks which kind of attention it is caching for.

Two small interfaces are shared with the paged cache (components/paged_kv_cache.py), so that a
layer and the model ask every kind of cache the same questions and never which kind it is:

    LayerCache.attend(q, k, v, slots, mask, bias, attend)   one layer: write, then attend
    StepCache.positions_and_mask(slots, window)             one forward: each row's positions
                                                            and what each new token may see

A quantized cache (`QuantizedKVCache`, and the paged pool's `QuantizedPagedLayer`) keeps each
token's key and value of each head as 8-bit codes and one fp32 scale, amax / qmax of that vector
(the largest entry maps to the largest code), and hands attention the dequantized codes:

    int8:      codes = round(x / scale) in [-127, 127]      error <= scale / 2 per entry
    fp8 e4m3:  codes = x / scale rounded to e4m3 (<= 448)   error <= 2^-4 of each entry (3 bits
                                                            of mantissa), less for small ones
    per token and layer: 2 * K * (D + 4) bytes against 2 * K * D * 4 in fp32 (D = 64: 0.27x)

Shapes: B batch, K kv heads, S_max slots, T new tokens, M memory length, D head_dim,
r kv_lora_rank, R qk_rope_head_dim.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.components.masks import cached_attention_mask

Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor | None], Tensor]
"""(q, k, v, mask, bias) -> (B, H, T, D): a layer's attention over the keys it is given."""


KV_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""The quantized cache dtypes and the largest code of each (the others keep floats as given)."""


KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""--kv-cache-dtype's names: auto keeps the model's float dtype (the reference)."""


def kv_cache_dtype(name: str) -> torch.dtype | None:
    """The cache dtype a --kv-cache-dtype name stands for; a ValueError naming the choices, or
    saying that this torch build cannot convert to fp8."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name]
    if dtype == torch.float8_e4m3fn:
        try:
            torch.ones(1).to(dtype).float()
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"kv cache dtype fp8: this torch build cannot convert to float8_e4m3fn ({err}); "
                "use int8"
            ) from None
    return dtype


def quantize_kv(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Keys or values (..., D) -> 8-bit codes (..., D) and one scale per vector (..., 1).

    Symmetric (no zero point): scale = amax / qmax over the vector's D entries. fp8 codes are
    kept as their bytes (uint8), since CPU torch cannot index_copy_ a float8 tensor.
    """
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / KV_CODE_MAX[dtype]  # (..., 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector: codes 0
    if dtype == torch.int8:
        return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale
    return (x / scale).to(dtype).view(torch.uint8), scale


def dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The float32 keys or values that `quantize_kv(x, dtype)`'s codes and scales stand for."""
    if dtype != torch.int8:
        codes = codes.view(dtype)
    return codes.float() * scale


def kv_token_bytes(K: int, D: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in one layer's cache of `dtype`."""
    if dtype in KV_CODE_MAX:
        return 2 * K * (D + 4)  # one byte per entry, one fp32 scale per head
    return 2 * K * D * torch.empty((), dtype=dtype).element_size()


class LayerCache:
    """What a self-attention layer asks of its cache: keep the new keys, attend to all of them."""

    def update(self, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Write new keys/values (B, K, T, D) at `slots`; return every key and value."""
        raise NotImplementedError

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        slots: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        attend: Attend,
        scale: float | None = None,
    ) -> Tensor:
        """Write the new keys and values at `slots`, then attend `q` to every cached key.

        Args:
            q: (B, H, T, D).  k, v: (B, K, T, D) the new tokens'.  slots: where they go.
            mask, bias: for the cached keys (the model's context).  attend: the layer's.
            scale: the layer's score scale (a cache that attends on its own needs it).

        Returns:
            (B, H, T, D).
        """
        k, v = self.update(k, v, slots)  # (B, K, S, D)
        return attend(q, k, v, mask, bias)


class StepCache:
    """What a model asks of a whole cache for one forward (the layers read `layers`, `cross`)."""

    layers: list
    cross: list | None

    def positions_and_mask(
        self, slots: Tensor, window: int | None
    ) -> tuple[Tensor, Tensor, int, Tensor]:
        """(pos, k_pos, bound, mask): the new tokens' positions (B, T), the keys' (B, S), a
        bound above every position, and the bool (B, 1, T, S) mask of what each may see."""
        raise NotImplementedError


class KVCache(LayerCache, nn.Module):
    """One self-attention layer's preallocated key/value buffers.

    Args:
        B: batch.  K: kv heads.  S_max: slots.  D: head_dim.  dtype, device: of the buffers.
    """

    def __init__(self, B: int, K: int, S_max: int, D: int, dtype=torch.float32, device=None):
        super().__init__()
        shape = (B, K, S_max, D)
        # Non-persistent: a cache is scratch space, never part of a checkpoint.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Write new keys/values at `slots` and return the whole buffers.

        Args:
            k, v: (B, K, T, D) for the T new tokens.  slots: (T,) int64 slot indices.

        Returns:
            (B, K, S_max, D) keys and values.
        """
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search)."""
        self.k, self.v = self.k[index], self.v[index]


class QuantizedKVCache(LayerCache, nn.Module):
    """A `KVCache` that keeps 8-bit codes and per-(token, head) scales (see the module's
    docstring) and hands attention the dequantized keys and values.

    Args:
        B, K, S_max, D: as KVCache's.  dtype: torch.int8 or torch.float8_e4m3fn.  device.
    """

    def __init__(self, B: int, K: int, S_max: int, D: int, dtype=torch.int8, device=None):
        super().__init__()
        self.dtype = dtype
        codes = torch.int8 if dtype == torch.int8 else torch.uint8  # fp8 kept as its bytes
        shape, scales = (B, K, S_max, D), (B, K, S_max, 1)
        # Non-persistent: a cache is scratch space, never part of a checkpoint.
        for name in ("k", "v"):
            self.register_buffer(
                name, torch.zeros(shape, dtype=codes, device=device), persistent=False
            )
            self.register_buffer(
                f"{name}_scale", torch.ones(scales, device=device), persistent=False
            )

    def update(self, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Quantize the new keys/values (B, K, T, D) into `slots`; return every key and value
        dequantized, (B, K, S_max, D) in k's dtype."""
        for name, x in (("k", k), ("v", v)):
            codes, scale = quantize_kv(x, self.dtype)
            getattr(self, name).index_copy_(2, slots, codes)
            getattr(self, f"{name}_scale").index_copy_(2, slots, scale)
        return (
            dequantize_kv(self.k, self.k_scale, self.dtype).to(k.dtype),
            dequantize_kv(self.v, self.v_scale, self.dtype).to(v.dtype),
        )

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search)."""
        self.k, self.v = self.k[index], self.v[index]
        self.k_scale, self.v_scale = self.k_scale[index], self.v_scale[index]


class LatentCache(nn.Module):
    """One MLA layer's preallocated latent buffers: c_kv (B, S_max, r) and k_pe (B, S_max, R).

    Per token this is r + R numbers, against 2 * K * D for a `KVCache` (DeepSeek-V2: 512 + 64
    against 2 * 128 * 128 for the MHA it replaces). The rope key is stored already rotated.

    Args:
        B: batch.  S_max: slots.  r: kv_lora_rank.  R: qk_rope_head_dim.  dtype, device.
    """

    def __init__(self, B: int, S_max: int, r: int, R: int, dtype=torch.float32, device=None):
        super().__init__()
        # Non-persistent: a cache is scratch space, never part of a checkpoint.
        self.register_buffer(
            "c_kv", torch.zeros(B, S_max, r, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "k_pe", torch.zeros(B, S_max, R, dtype=dtype, device=device), persistent=False
        )

    def update(self, c_kv: Tensor, k_pe: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new tokens' latents at `slots` and return the whole buffers.

        Args:
            c_kv: (B, T, r).  k_pe: (B, T, R), rotated.  slots: (T,) int64 slot indices.

        Returns:
            c_kv (B, S_max, r) and k_pe (B, S_max, R).
        """
        self.c_kv.index_copy_(1, slots, c_kv.to(self.c_kv.dtype))
        self.k_pe.index_copy_(1, slots, k_pe.to(self.k_pe.dtype))
        return self.c_kv, self.k_pe

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search)."""
        self.c_kv, self.k_pe = self.c_kv[index], self.k_pe[index]


class CrossKV(nn.Module):
    """Cross-attention keys/values, computed once per source and reused for every new token."""

    def __init__(self):
        super().__init__()
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def get(self, compute) -> tuple[Tensor, Tensor]:
        """compute: a callable returning (k, v), each (B, K, M, D); called only the first time."""
        if self.k is None:
            self.k, self.v = compute()
        return self.k, self.v


class ModelCache(StepCache, nn.Module):
    """All layers' caches for one generation, plus what every layer needs to read them.

    Args:
        layers: one cache per decoder block (a KVCache, or a LatentCache for MLA).
        cross: one CrossKV per block (encoder-decoder models), or None.
        key_valid: (B, S_max) bool, False for left padding. Slots not yet written are hidden by
            causality (a query at slot s sees slots <= s), so they can be marked True up front.
    """

    def __init__(self, layers: list[nn.Module], cross: list[CrossKV] | None, key_valid: Tensor):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.cross = nn.ModuleList(cross) if cross is not None else None
        self.register_buffer("key_valid", key_valid, persistent=False)  # (B, S_max)
        # Each row counts positions from its first real token: left padding does not shift them.
        pos = (key_valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, S_max)
        self.register_buffer("pos", pos, persistent=False)

    @classmethod
    def for_decoder(
        cls,
        decoder: nn.Module,
        key_valid: Tensor,
        cross: bool = False,
        dtype: torch.dtype | None = None,
    ) -> "ModelCache":
        """Preallocate caches shaped for `decoder`'s blocks: each attention makes its own."""
        B, S_max = key_valid.shape
        weight = decoder.embed.weight  # float even when the head is quantized
        dtype = weight.dtype if dtype is None else dtype
        layers = [
            blk.self_attn.make_cache(B, S_max, dtype, weight.device) for blk in decoder.blocks
        ]
        crosses = [CrossKV() for _ in decoder.blocks] if cross else None
        return cls(layers, crosses, key_valid)

    def positions_and_mask(
        self, slots: Tensor, window: int | None
    ) -> tuple[Tensor, Tensor, int, Tensor]:
        """As StepCache's, for new tokens at `slots` (T,) of the preallocated buffers."""
        k_pos = self.pos  # (B, S_max)
        bound = k_pos.shape[1]  # a row's positions never exceed its slots
        return k_pos[:, slots], k_pos, bound, cached_attention_mask(slots, self.key_valid, window)

    def layout(self) -> tuple:
        """What a compiled decode step specializes on: each buffer's shape, dtype and device,
        and each cross-attention K/V's shape (None until computed)."""
        buffers = tuple((b.shape, b.dtype, b.device) for b in self.buffers())
        cross = tuple(None if c.k is None else c.k.shape for c in self.cross or ())
        return buffers, cross

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (beam search): every buffer is gathered along the batch dimension."""
        for layer in self.layers:
            layer.reorder(index)
        for c in self.cross or []:
            if c.k is not None:
                c.k, c.v = c.k[index], c.v[index]
        self.key_valid, self.pos = self.key_valid[index], self.pos[index]
