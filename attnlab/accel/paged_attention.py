"""Compiled decode attention over a paged KV cache: keys and values read in place, once.

The plain path (components/paged_kv_cache.py) answers a decode step's queries, one per row, in
two moves: gather each row's keys and values out of the pool into a fresh (B, S, K, D) copy,
then hand the copy to SDPA. Every key crosses memory three times (read, write, read again), and
SDPA's CPU kernel is built for blocks of queries, not one. Written as products and sums over
the pool indexed by slot,

    s[b, j, h] = scale * sum_d q[b, h, d] * k_pool[slot[b, j], h // G, d]     (+ bias, mask)
    p = softmax over j of s
    out[b, h, d] = sum_j p[b, j, h] * v_pool[slot[b, j], h // G, d]

torch.compile's inductor emits loops that load each key and value straight from the pool
through the slot table: nothing is copied, each key is read once. Outside torch.compile the
same code would materialise the gathers and the (B, S, K, G, D) products, so it only runs
compiled. The math is attention's; only the summation order differs (~1e-6 relative).

`use_compiled_decode(cache)` turns it on for a PagedKVCache (the serving engine's
`compile_attention` option); steps of more than one query per row (prefill chunks) keep the
plain path.

Shapes: B rows, H query heads, K kv heads (G = H // K queries per kv head), S keys per row,
D head_dim.
"""

import math

import torch
from torch import Tensor

from attnlab.components.paged_kv_cache import PagedKVCache


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    key_slots: Tensor,
    mask: Tensor,
    bias: Tensor | None,
    scale: float | None,
) -> Tensor:
    """One query per row attending to its keys in the pool (to be compiled; see above).

    Args:
        q: (B, H, 1, D).  k_pool, v_pool: (n_slots, K, D) the flat pools.
        key_slots: (B, S) pool slot of each row's key j.  mask: bool (B, 1, 1, S), True = may
        attend.  bias: broadcastable to (B, H, 1, S), or None.  scale: None = 1 / sqrt(D).

    Returns:
        (B, H, 1, D).
    """
    B, H, _, D = q.shape
    K = k_pool.shape[1]
    G = H // K
    scale = 1 / math.sqrt(D) if scale is None else scale
    k = k_pool[key_slots]  # (B, S, K, D): an indexed load inside the compiled loops
    qg = q.reshape(B, 1, K, G, D)
    s = (qg * k[:, :, :, None, :]).sum(-1) * scale  # (B, S, K, G)
    if bias is not None:
        s = s + bias.expand(B, H, 1, -1)[:, :, 0].transpose(1, 2).reshape(B, -1, K, G)
    s = s.masked_fill(~mask[:, 0, 0, :, None, None], float("-inf"))
    p = torch.softmax(s, dim=1)  # over the keys
    v = v_pool[key_slots]  # (B, S, K, D)
    out = (p[..., None] * v[:, :, :, None, :]).sum(1)  # (B, K, G, D)
    return out.reshape(B, H, 1, D)


_compiled = None


def compiled_decode_attention():
    """paged_decode_attention under torch.compile (built once, shapes dynamic)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(paged_decode_attention, dynamic=True)
    return _compiled


def use_compiled_decode(cache: PagedKVCache, n_heads: int, scale: float | None) -> None:
    """Have `cache`'s one-query-per-row steps attend through the compiled kernel.

    Compiles now, for the model's n_heads and scale (its attention layers'), with one row and
    with two, without and with a bias: torch.compile specialises a size of 1 and compiles each
    form on first use, and no request should wait for the compiler.
    """
    fn = compiled_decode_attention()
    layer = cache.layers[0]
    k_pool, v_pool = layer.slots_view()
    D, like = k_pool.shape[-1], dict(dtype=k_pool.dtype, device=k_pool.device)
    S = 2 * cache.block_size
    try:
        for B in (1, 2):
            q = torch.zeros(B, n_heads, 1, D, **like)
            slots = torch.zeros(B, S, dtype=torch.long, device=k_pool.device)
            mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=k_pool.device)
            fn(q, k_pool, v_pool, slots, mask, None, scale)
            fn(q, k_pool, v_pool, slots, mask, torch.zeros(B, n_heads, 1, S, **like), scale)
    except Exception as err:  # no C compiler, an unsupported platform: say so in one line
        line = f"{type(err).__name__}: {err}".splitlines()[0]
        raise RuntimeError(f"the paged decode attention did not compile ({line})") from err
    cache.decode_attention = fn
