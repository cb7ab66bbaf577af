"""The serving engine's decode step as one compiled graph over the paged KV pool.

The batched engine (serve/engine.py) decodes each step eagerly: a forward of the model with a
`PagedStep` (components/paged_kv_cache.py) as its cache, which writes each layer's new keys
and values into the pool and attends each group of rows to theirs. On a small model, one
request at a time, about half of a step is Python: some 600 module calls a token, each a few
microseconds, around the matrix products (benchmarks/README.md section 9a: SmolLM2's int4 step
spent 14 of its ~30 ms in the int4 kernel).

`CompiledPagedDecode` runs the same forward under torch.compile, with a cache built for the
graph: `PoolStep` and its `PoolLayer`s hold only tensors (the flat pools, each row's key slots,
the new tokens' slots and positions), so the whole step, from the embedding to the logits,
is one graph of fused loops. Its attention is `paged_decode_attention` (paged_attention.py),
which reads every key and value straight from the pool; all rows attend as one group, as far
as the longest row (the eager step splits rows of very different lengths into groups).

What can change between two steps is the number of rows and how far they reach: the graph is
compiled with dynamic shapes, one copy for a single row and one for several (torch.compile
specialises a size of 1), without Dynamo's guards (compiled_step.py says why: thousands of them
for a whole model). So the model must not change after `CompiledPagedDecode` was made (its
weights, adapters, hooks), and the pool must be a float one (not --kv-cache-dtype int8/fp8).
Tested equal to the eager step (tests/accel/test_paged_step.py).
"""

import torch
from torch import Tensor, nn

from attnlab.accel.inductor import NO_ASSERTS, VECTOR_BITS, compile_unguarded
from attnlab.accel.paged_attention import paged_decode_attention
from attnlab.components.paged_kv_cache import PagedKVCache, PagedStep, QuantizedPagedLayer


class PoolLayer:
    """One layer's view of the pool for a decode step: write the new keys and values at their
    slots, attend each row's one query to its keys (the `LayerCache.attend` interface)."""

    def __init__(self, k_slots: Tensor, v_slots: Tensor, step: "PoolStep"):
        self.k_slots, self.v_slots, self.step = k_slots, v_slots, step  # (n_slots, K, D) pools

    def attend(self, q, k, v, slots, mask, bias, attend, scale=None) -> Tensor:
        """q (B, H, 1, D), the new k, v (B, K, 1, D) at slots (B, 1) -> (B, H, 1, D)."""
        self.k_slots[slots] = k.transpose(1, 2).to(self.k_slots.dtype)  # (B, 1, K, D)
        self.v_slots[slots] = v.transpose(1, 2).to(self.v_slots.dtype)
        key_slots = self.step.key_slots
        return paged_decode_attention(q, self.k_slots, self.v_slots, key_slots, mask, bias, scale)


class PoolStep:
    """A decode step's cache, of tensors only (`PagedStep`'s interface for one query a row).

    Args:
        pools: each layer's flat (keys, values) pools.  key_slots: (B, S) the pool slot of
        each row's position j.  slots: (B, 1) the new tokens' slots.  pos: (B, 1) their
        positions.
    """

    cross = None  # decoder-only

    def __init__(self, pools, key_slots: Tensor, slots: Tensor, pos: Tensor):
        self.key_slots, self.slots, self.pos = key_slots, slots, pos
        B, S = key_slots.shape
        self.bound = S
        self.key_pos = torch.arange(S, device=pos.device).expand(B, S)
        self.layers = [PoolLayer(k, v, self) for k, v in pools]

    def positions_and_mask(self, slots: Tensor, window: int | None):
        """As PagedStep's, whose mask it builds (query at position p sees keys j <= p)."""
        mask = PagedStep.attention_mask(self, window)  # (B, 1, 1, S), from pos and key_pos
        return self.pos, self.key_pos, self.bound, mask


def decode_logits(decoder: nn.Module, pools, ids, key_slots, slots, pos) -> Tensor:
    """One decode step: ids (B, 1) at slots and positions (B, 1) -> next logits (B, V)."""
    step = PoolStep(pools, key_slots, slots, pos)
    return decoder(ids, cache=step, slots=slots)[:, -1]


class CompiledPagedDecode:
    """`decode_logits` compiled for one decoder and its pool (see the module docstring).

    Args:
        decoder: the DecoderLM the engine serves.  cache: its PagedKVCache (float pools).
    """

    def __init__(self, decoder: nn.Module, cache: PagedKVCache):
        if any(isinstance(layer, QuantizedPagedLayer) for layer in cache.layers):
            raise ValueError(
                "the compiled decode step reads a float KV pool: serve a quantized KV cache "
                "without --compile"
            )
        self.decoder, self.cache = decoder, cache
        self.pools = [layer.slots_view() for layer in cache.layers]
        options = {**NO_ASSERTS, **VECTOR_BITS}
        self.steps = {  # one copy (code object) per form: a graph never runs on the other's
            rows: compile_unguarded(decode_logits, options, dynamic=True)
            for rows in ("one", "several")
        }

    def __call__(self, ids: Tensor, step: PagedStep) -> Tensor:
        """ids (B, 1) through the step's slots -> logits (B, V)."""
        fn = self.steps["one" if ids.shape[0] == 1 else "several"]
        return fn(self.decoder, self.pools, ids, step.key_slots, step.slots, step.pos)

    def warm_up(self) -> None:
        """Compile both forms now (1 and 2 rows), so that no request waits for the compiler;
        a failure (no C compiler) is one RuntimeError line. An eager step runs first: layers
        that build a kernel's layout on first use (quantize/int4.py, int8.py) build it then,
        never inside the graph, which would otherwise take their reference path."""
        cache = self.cache
        try:
            for B in (1, 2):
                seqs = [("warm-up", b) for b in range(B)]
                for seq in seqs:
                    cache.add(seq)
                try:
                    step = cache.step(seqs, [0] * B, 1)
                    ids = torch.zeros(B, 1, dtype=torch.long, device=step.slots.device)
                    with torch.no_grad():
                        self.decoder(ids, cache=step, slots=step.slots)  # eager
                        self(ids, step)
                finally:
                    for seq in seqs:
                        cache.free(seq, clear=True)  # what the warm-up wrote is zeroed
        except Exception as err:
            line = f"{type(err).__name__}: {err}".splitlines()[0]
            raise RuntimeError(f"the decode step did not compile ({line})") from err
