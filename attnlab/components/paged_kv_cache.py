"""A paged KV cache: PagedAttention's idea (Kwon et al. 2023, vLLM) written in PyTorch.

The static cache (kv_cache.py) gives every row of a batch the same S_max slots up front. A server
with many requests of different lengths would reserve the longest one's room for all of them.
Here keys and values live in a pool of fixed-size blocks; a sequence owns a list of blocks (its
block table) that grows one block at a time, and returns them when it finishes.

    pool, one per layer: (n_blocks, block_size, K, D) keys and the same for values
    (block_size 4; letters are tokens, . is a free slot)

        block:     0         1         2         3         4         5
                [a b c d] [w x y z] [e f g .] [u v . .] [. . . .] [. . . .]

    block tables (shared by all layers: block i of a sequence is block i in every layer's pool)

        seq A: [0, 2]    length 7: positions 0-3 in block 0, 4-6 in block 2
        seq B: [1, 3]    length 6: positions 0-3 in block 1, 4-5 in block 3
        free list: [4, 5]

    one decode step of both (B = 2, T = 1): each new token goes to its own row's next position

        A, position 7 -> block A[7 // 4] = 2, offset 7 % 4 = 3 -> pool slot 2 * 4 + 3 = 11
        B, position 6 -> block B[6 // 4] = 3, offset 6 % 4 = 2 -> pool slot 3 * 4 + 2 = 14

        written with one index_put per layer at slots (B, T) = [[11], [14]]; then each row's keys
        are gathered through its table: the slots of its positions 0 .. 7, computed once per step
        (A: [0 1 2 3 8 9 10 11], B: [4 5 6 7 12 13 14 15]), one index_select of the flat pool
        per layer -> (B, 2 blocks * 4, K, D): key j of row b is the token at position j of
        sequence b. The mask lets query position p see keys j <= p, which also hides the slots a
        shorter row has not written (B's slot 7, any padding block).

Prefix caching: keys and values at a position depend only on the tokens up to it, so a full
block of one prompt serves every later prompt that starts with the same tokens. Such blocks are
indexed by those tokens (`register_prefix`); a new sequence shares them (`match_prefix`,
reference counted) and computes only the rest. The index is a chain: a block's key is (the
entry of the block before it, its own block_size tokens), so each entry holds one block's tokens
however long the prompt (a key of every token up to the block's end would hold, summed over an
8k-token prompt's 512 blocks, 2 million token ids). A prompt C that starts like A (a b c d ...):

        seq A: [0, 2]            seq C: [0, 4]        block 0 shared: refs[0] = 2

A shared block is never written again (it is full, and new tokens go to later blocks). A block
that no sequence owns but that holds a prefix stays cached until the pool needs it back.

Rows of one step have their own lengths, and gathering every row as far as the longest would
spend most of a step's copying and attention on padding when one long request decodes beside
many short ones. So a step sorts its rows by length and splits them into a few groups of similar
length (`row_groups`); each group gathers its keys only as far as its own longest row and
attends on its own (`PagedLayerView.attend`, which the Attention layer calls as it calls the
static cache's: kv_cache.py's `LayerCache`):

    rows' blocks 2 2 3 9 10 -> groups [2 2 3] gathering 3 blocks and [9 10] gathering 10:
    3*3 + 2*10 = 29 blocks' worth of keys per layer instead of 5*10 = 50

A step is described by a `PagedStep` (the `cache` a DecoderLM forward takes, with
`slots=step.slots`): its per-layer views write and gather, and it hands the model each row's
positions and mask. Every row of one step feeds the same number T of new tokens (a batched decode
step: T = 1 per row; a prefill chunk: one row of T tokens).

Shapes: B batch, K kv heads, T new tokens, S keys gathered per row (blocks * block_size),
D head_dim, L layers.
"""

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn

from attnlab.components.attention import Attention
from attnlab.components.kv_cache import (
    KV_CODE_MAX,
    Attend,
    LayerCache,
    StepCache,
    dequantize_kv,
    kv_token_bytes,
    quantize_kv,
)


class NoFreeBlocks(RuntimeError):
    """The pool has no free block left for a sequence that needs one."""


class BlockAllocator:
    """The pool's books: which blocks are free, and how many sequences share each block.

    A block whose last owner finished goes back to the free list, unless it holds a registered
    prompt prefix (prefix caching): then it waits in `cached`, still free to take, so that a
    later prompt with the same prefix can share it. A sequence that needs a block takes one in
    this order: a free block that was used before, the least recently cached one, and only then
    one never used. The pool's memory is touched as blocks are first used (a quiet server holds
    little), and cached prefixes never make it grow: it grows to what the running sequences
    have needed at once, not to its whole budget.

    Args:
        n_blocks: blocks in the pool.
    """

    def __init__(self, n_blocks: int):
        if n_blocks < 1:
            raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
        self.n_blocks = n_blocks
        self.free: list[int] = []  # used before, holding nothing reusable: the last released first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unowned, holding a prefix
        self.fresh: list[int] = list(range(n_blocks - 1, -1, -1))  # never used: 0, 1, ... next
        self.refs = [0] * n_blocks  # sequences sharing each block

    @property
    def n_free(self) -> int:
        """Blocks no sequence owns (free, cached or never used)."""
        return len(self.free) + len(self.cached) + len(self.fresh)

    def allocate(self) -> int:
        """Take one block no sequence owns: a free one, else the least recently cached one
        (whose prefix the caller must forget), else one never used."""
        if self.free:
            block = self.free.pop()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
        elif self.fresh:
            block = self.fresh.pop()
        else:
            raise NoFreeBlocks(f"all {self.n_blocks} KV blocks are in use")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence reads `block` (a prefix hit)."""
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def release(self, block: int, keep: bool = False) -> None:
        """One sequence fewer owns `block`; when none is left it is free again (cached with
        `keep`)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if keep:
                self.cached[block] = None
            else:
                self.free.append(block)


GROUP_COST_BLOCKS = 16  # one more row group costs about as much as this many padded blocks
#                        (four more kernel calls per layer against a block's copy and attention)


def row_groups(n_blocks: Sequence[int], group_cost: int = GROUP_COST_BLOCKS) -> list[list[int]]:
    """Split a step's rows into groups of similar length, each gathering as far as its longest.

    Rows sorted by length split into consecutive runs; a run of rows i .. j-1 (sorted) costs
    (j - i) * its longest row's blocks, plus `group_cost` per group. The cheapest split comes from
    dynamic programming over where runs end: best[j] = min over i of best[i] + cost(i, j).

    Args:
        n_blocks: (B,) blocks each row reads.  group_cost: the price of one more group, in blocks.

    Returns:
        groups of row indices, shortest rows first.
    """
    order = sorted(range(len(n_blocks)), key=lambda r: n_blocks[r])
    length = [n_blocks[r] for r in order]  # ascending
    best, start = [0] + [None] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + (j - i) * length[j - 1] + group_cost
            if best[j] is None or cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[start[j] : j])
        j = start[j]
    return groups[::-1]


class PagedLayer(nn.Module):
    """One layer's pool: (n_blocks, block_size, K, D) keys and values.

    Token-major: the block_size tokens of a block follow each other, each with its K heads, so
    the pool is also a flat (n_blocks * block_size, K, D) array of slots, and one index_select
    of whole slots gathers a row's keys already in position order.

    Args:
        n_blocks, K, block_size, D: pool shape.  dtype, device: of the buffers.
    """

    def __init__(self, n_blocks: int, K: int, block_size: int, D: int, dtype, device=None):
        super().__init__()
        shape = (n_blocks, block_size, K, D)
        # Non-persistent: a cache is scratch space, never part of a checkpoint. Left unwritten
        # (empty, not zeros): the operating system maps a page of it only when it is first
        # written, so a pool holds memory as its blocks are used (each zeroed when first taken:
        # PagedKVCache.reserve), not all of it at start.
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)

    def slots_view(self) -> tuple[Tensor, Tensor]:
        """The pools as flat (n_blocks * block_size, K, D) arrays of slots (views, no copy)."""
        n_blocks, block_size, K, D = self.k.shape
        return self.k.view(n_blocks * block_size, K, D), self.v.view(n_blocks * block_size, K, D)

    def write(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """Store the new tokens' keys and values.

        Args:
            k, v: (B, K, T, D).  slots: (B, T) pool slots, block * block_size + offset.
        """
        k_slots, v_slots = self.slots_view()
        k_slots[slots] = k.transpose(1, 2).to(self.k.dtype)  # (B, T, K, D) at (B, T) slots
        v_slots[slots] = v.transpose(1, 2).to(self.v.dtype)

    def gather(self, key_slots: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's keys and values in position order.

        Args:
            key_slots: (B, S) the pool slot of each row's position j (`PagedStep.key_slots`).

        Returns:
            keys and values, each (B, K, S, D) (a transposed view of one (B, S, K, D) copy).
        """
        B, S = key_slots.shape
        k_slots, v_slots = self.slots_view()
        index = key_slots.reshape(B * S)
        k = k_slots.index_select(0, index).view(B, S, *k_slots.shape[1:])  # (B, S, K, D)
        v = v_slots.index_select(0, index).view(B, S, *v_slots.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, K, S, D)

    def clear(self, blocks: Sequence[int]) -> None:
        """Zero `blocks` (so a non-finite value left by a failed request cannot reach a row
        that reads the block as masked padding: 0 * NaN is NaN)."""
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self.k.device)
        self.k[index] = 0
        self.v[index] = 0


class QuantizedPagedLayer(nn.Module):
    """A `PagedLayer` of 8-bit codes and per-(slot, head) fp32 scales (kv_cache.py's
    `quantize_kv`); `gather` hands back the dequantized keys and values.

    Args:
        n_blocks, K, block_size, D: pool shape.  dtype: torch.int8 or torch.float8_e4m3fn.
        out_dtype: what `gather` returns (the model's).  device.
    """

    def __init__(
        self, n_blocks: int, K: int, block_size: int, D: int, dtype, out_dtype, device=None
    ):
        super().__init__()
        self.dtype, self.out_dtype = dtype, out_dtype
        codes = torch.int8 if dtype == torch.int8 else torch.uint8  # fp8 kept as its bytes
        for name in ("k", "v"):  # empty, as PagedLayer's: touched as first used
            self.register_buffer(
                name,
                torch.empty(n_blocks, block_size, K, D, dtype=codes, device=device),
                persistent=False,
            )
            self.register_buffer(
                f"{name}_scale",
                torch.empty(n_blocks, block_size, K, 1, device=device),
                persistent=False,
            )

    def slots_view(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("a quantized pool is read through `gather` (dequantized)")

    def write(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """Quantize and store the new tokens' keys and values: k, v (B, K, T, D), slots (B, T)."""
        for name, x in (("k", k), ("v", v)):
            codes, scale = quantize_kv(x.transpose(1, 2), self.dtype)  # (B, T, K, D), (B, T, K, 1)
            self._flat(name)[slots] = codes
            self._flat(f"{name}_scale")[slots] = scale

    def gather(self, key_slots: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's keys and values in position order, dequantized: each (B, K, S, D)."""
        B, S = key_slots.shape
        index = key_slots.reshape(B * S)
        out = []
        for name in ("k", "v"):
            codes = self._flat(name).index_select(0, index)  # (B * S, K, D)
            scale = self._flat(f"{name}_scale").index_select(0, index)  # (B * S, K, 1)
            x = dequantize_kv(codes, scale, self.dtype).to(self.out_dtype)
            out.append(x.view(B, S, *x.shape[1:]).transpose(1, 2))  # (B, K, S, D)
        return out[0], out[1]

    def clear(self, blocks: Sequence[int]) -> None:
        """Zero `blocks`' codes (scales 1), as PagedLayer.clear."""
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self.k.device)
        self.k[index] = 0
        self.v[index] = 0
        self.k_scale[index] = 1
        self.v_scale[index] = 1

    def _flat(self, name: str) -> Tensor:
        """Buffer `name` as a flat (n_blocks * block_size, K, ...) array of slots."""
        buf = getattr(self, name)
        return buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:])


class PagedLayerView(LayerCache):
    """What one attention layer sees as its cache for one step: `update` as KVCache's, with
    per-row slots, and `attend`, which attends each group of rows on its own."""

    def __init__(self, layer: PagedLayer, step: "PagedStep"):
        self.layer, self.step = layer, step

    def update(self, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys/values (B, K, T, D) at `slots` (B, T) and return every row's keys
        and values (B, K, S, D) through its block table."""
        self.layer.write(k, v, slots)
        return self.layer.gather(self.step.key_slots)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        slots: Tensor,
        mask: Tensor,
        bias: Tensor | None,
        attend: Attend,
        scale: float | None = None,
    ) -> Tensor:
        """Write the new keys/values, then attend each of the step's row groups to its own keys,
        gathered as far as the group's longest row.

        Args:
            q: (B, H, T, D) queries.  k, v: (B, K, T, D) the new keys and values.
            slots: (B, T) their pool slots.  mask: bool (B, 1, T, S) (`PagedStep.attention_mask`).
            bias: a score bias broadcastable to (B, H, T, S), or None.
            attend: (q, k, v, mask, bias) of one group -> its (b, H, T, D) output.
            scale: the layer's score scale (None: 1 / sqrt(D)), for `decode_attention`.

        Returns:
            (B, H, T, D), row b as if all rows had attended together.
        """
        self.layer.write(k, v, slots)
        decode = self.step.decode_attention if q.shape[2] == 1 else None
        out = q.new_empty(q.shape)  # (B, H, T, D)
        for rows, S in self.step.groups:
            key_slots, mask_g = self.step.key_slots[rows, :S], mask[rows, ..., :S]
            bias_g = None
            if bias is not None:
                bias_g = (bias if bias.shape[0] == 1 else bias[rows])[..., :S]
            if decode is not None:  # an accelerator reads the pool in place (accel/)
                out[rows] = decode(
                    q[rows], *self.layer.slots_view(), key_slots, mask_g, bias_g, scale
                )
            else:
                k_g, v_g = self.layer.gather(key_slots)  # (b, K, S, D)
                out[rows] = attend(q[rows], k_g, v_g, mask_g, bias_g)
        return out


class PagedStep(StepCache):
    """One forward over a paged cache: the `cache` argument of `DecoderLM.forward`.

    Attributes:
        layers: one PagedLayerView per decoder block.
        cross: None (decoder-only models).
        slots: (B, T) pool slots of the new tokens (pass as `slots=`).
        pos: (B, T) positions of the new tokens in their sequences.
        key_pos: (B, S) positions of the gathered keys: 0 .. S-1 in every row.
        key_slots: (B, S) pool slot of each gathered key, through the row's block table
            (computed once per step, shared by every layer).
        groups: (rows, S_g) per group of rows of similar length (`row_groups`): the rows'
            indices and how many keys the group gathers.
        decode_attention: the cache's (see PagedKVCache), for steps of one query per row.
        bound: S, above every position of the step.
    """

    def __init__(
        self,
        layers: list[PagedLayer],
        tables: Tensor,
        slots: Tensor,
        pos: Tensor,
        group_cost: int = GROUP_COST_BLOCKS,
        decode_attention: Callable | None = None,
    ):
        B, N = tables.shape
        self.decode_attention = decode_attention
        block_size = layers[0].k.shape[1]
        offsets = torch.arange(block_size, device=tables.device)
        self.key_slots = (tables[:, :, None] * block_size + offsets).reshape(B, N * block_size)
        n_blocks = (pos[:, -1] // block_size + 1).tolist()  # blocks each row reads
        self.groups = [
            (torch.tensor(rows, device=tables.device), max(n_blocks[r] for r in rows) * block_size)
            for rows in row_groups(n_blocks, group_cost)
        ]
        self.layers = [PagedLayerView(layer, self) for layer in layers]
        self.cross = None
        self.slots, self.pos = slots, pos
        self.bound = N * block_size
        self.key_pos = torch.arange(self.bound, device=pos.device).expand(B, self.bound)

    def positions_and_mask(
        self, slots: Tensor, window: int | None
    ) -> tuple[Tensor, Tensor, int, Tensor]:
        """As StepCache's: the step's own positions (its `slots` are `self.slots`)."""
        return self.pos, self.key_pos, self.bound, self.attention_mask(window)

    def attention_mask(self, window: int | None = None) -> Tensor:
        """Query at position p sees keys j <= p (within `window`): bool (B, 1, T, S).

        Keys past a row's length are never below its queries' positions, so causality also hides
        unwritten slots and padding blocks."""
        q = self.pos[:, :, None]  # (B, T, 1)
        j = self.key_pos[:, None, :]  # (B, 1, S)
        mask = j <= q
        if window is not None:
            mask = mask & (j > q - window)
        return mask[:, None]  # (B, 1, T, S)


class PagedKVCache(nn.Module):
    """A decoder's paged cache: one pool per layer, one free list and one block table per
    sequence (shared by all layers).

    Args:
        decoder: the DecoderLM whose blocks' self-attention is cached (Attention layers; an MLA
            layer keeps a latent cache, which this pool does not hold).
        n_blocks: blocks in each layer's pool.
        block_size: tokens per block.
        dtype: of the pools (default: the embedding's); torch.int8 or torch.float8_e4m3fn keep
            8-bit codes and scales (`QuantizedPagedLayer`).
        group_cost: the price of one more row group in a step, in blocks (`row_groups`).
    """

    def __init__(
        self,
        decoder: nn.Module,
        n_blocks: int,
        block_size: int = 16,
        dtype=None,
        group_cost: int = GROUP_COST_BLOCKS,
    ):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        weight = decoder.embed.weight
        dtype = weight.dtype if dtype is None else dtype
        layers = []
        for i, blk in enumerate(decoder.blocks):
            attn = blk.self_attn
            if type(attn) is not Attention:
                raise ValueError(
                    f"block {i}: a paged cache holds Attention keys/values, not a "
                    f"{type(attn).__name__} (MLA and cross-attention models: use the static cache)"
                )
            K, D = attn.n_kv_heads, attn.head_dim
            if dtype in KV_CODE_MAX:
                layer = QuantizedPagedLayer(
                    n_blocks, K, block_size, D, dtype, weight.dtype, weight.device
                )
            else:
                layer = PagedLayer(n_blocks, K, block_size, D, dtype, weight.device)
            layers.append(layer)
        if getattr(decoder.blocks[0], "cross_attn", None) is not None:
            raise ValueError("a paged cache is for decoder-only models (this one cross-attends)")
        self.layers = nn.ModuleList(layers)
        self.block_size, self.n_blocks, self.group_cost = block_size, n_blocks, group_cost
        self.dtype = dtype
        # Set by an accelerator (accel/paged_attention.py): attends one query per row straight
        # from the pool, (q, k_pool, v_pool, key_slots, mask, bias, scale) -> out. None: gather.
        self.decode_attention: Callable | None = None
        self.allocator = BlockAllocator(n_blocks)
        self.used: set[int] = set()  # blocks taken at least once (zeroed then)
        self.tables: dict[Hashable, list[int]] = {}
        # Prefix caching: (the entry of the block before, a full block's tokens) -> (the block
        # holding their keys/values, this entry's id). The first block's "entry before" is the
        # salt; ids are never reused, so a key naming a forgotten entry matches nothing.
        self.prefixes: dict[tuple, tuple[int, int]] = {}
        self.prefix_of: dict[int, tuple] = {}  # block -> its key in `prefixes`
        self.entries = 0  # ids handed out

    @staticmethod
    def token_bytes(decoder: nn.Module, dtype=None) -> int:
        """Bytes one token's keys and values take in a pool for `decoder` (all its layers)."""
        dtype = decoder.embed.weight.dtype if dtype is None else dtype
        return sum(
            kv_token_bytes(b.self_attn.n_kv_heads, b.self_attn.head_dim, dtype)
            for b in decoder.blocks
        )

    @property
    def capacity(self) -> int:
        """Tokens the pool holds."""
        return self.n_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (keys and values of every layer)."""
        return sum(buffer.nbytes for buffer in self.buffers())

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens tokens."""
        return -(-n_tokens // self.block_size)

    @property
    def n_free(self) -> int:
        """Blocks no sequence owns."""
        return self.allocator.n_free

    def add(self, seq: Hashable) -> None:
        """Start an empty block table for a new sequence."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} is already in the cache")
        self.tables[seq] = []

    def reserve(self, seq: Hashable, n_tokens: int) -> None:
        """Grow `seq`'s table until it holds n_tokens tokens (all or nothing)."""
        table = self.tables[seq]
        missing = self.blocks_for(n_tokens) - len(table)
        if missing > self.allocator.n_free:
            raise NoFreeBlocks(
                f"sequence {seq!r} needs {missing} more KV blocks, {self.allocator.n_free} are free"
            )
        for _ in range(missing):
            block = self.allocator.allocate()
            if block in self.prefix_of:  # a cached prefix block taken back: forget its prefix
                del self.prefixes[self.prefix_of.pop(block)]
            if block not in self.used:  # first taken: zeroed (masked slots are read as 0 * v)
                self.used.add(block)
                for layer in self.layers:
                    layer.clear([block])
            table.append(block)

    def match_prefix(self, seq: Hashable, prompt: Sequence[int], salt: tuple = ()) -> int:
        """Share the cached blocks of the longest prefix of `prompt` seen before, in whole
        blocks, leaving at least its last token to compute (its logits are the first token's).

        Call on a new sequence (empty table). `salt` keeps apart prompts whose keys differ for
        the same tokens (another LoRA adapter's: the serve engine's). Returns the number of
        tokens whose keys and values are already in its table.
        """
        table, n, before = self.tables[seq], 0, salt
        while (n + self.block_size) < len(prompt):
            entry = self.prefixes.get((before, tuple(prompt[n : n + self.block_size])))
            if entry is None:
                break
            block, before = entry
            self.allocator.share(block)
            table.append(block)
            n += self.block_size
        return n

    def register_prefix(
        self, seq: Hashable, prompt: Sequence[int], end: int, salt: tuple = ()
    ) -> None:
        """Offer the full blocks of `prompt` that `seq` holds up to position `end` to later
        prompts with the same prefix (and the same `salt`, as `match_prefix`)."""
        table, size, before = self.tables[seq], self.block_size, salt
        for i in range(end // size):  # the chain from the first block (matched, or ours)
            key = (before, tuple(prompt[i * size : (i + 1) * size]))
            entry = self.prefixes.get(key)
            if entry is None:  # new, or forgotten since (its block taken back): ours now
                if table[i] in self.prefix_of:
                    return  # ours is indexed under a forgotten entry: the chain ends here
                self.entries += 1
                entry = self.prefixes[key] = (table[i], self.entries)
                self.prefix_of[table[i]] = key
            before = entry[1]

    def free(self, seq: Hashable, clear: bool = False) -> None:
        """Return `seq`'s blocks to the pool. With `clear` (the sequence failed), the blocks it
        alone owns are zeroed and forgotten as prefixes."""
        table = self.tables.pop(seq)
        if clear:
            own = [b for b in table if self.allocator.refs[b] == 1]
            for block in own:
                if block in self.prefix_of:
                    del self.prefixes[self.prefix_of.pop(block)]
            if own:
                for layer in self.layers:
                    layer.clear(own)
        for block in table:
            self.allocator.release(block, keep=block in self.prefix_of)

    def step(self, seqs: Sequence[Hashable], starts: Sequence[int], T: int) -> PagedStep:
        """Describe a forward that writes T new tokens per row, row b at positions
        starts[b] .. starts[b] + T - 1 of sequence seqs[b] (allocating blocks as needed).

        Writing the same positions again (a step re-run) writes the same slots.

        Returns:
            the PagedStep to pass as `cache` (and its `.slots` as `slots`) to the decoder.
        """
        need = sum(
            max(0, self.blocks_for(s + T) - len(self.tables[q])) for q, s in zip(seqs, starts)
        )
        if need > self.allocator.n_free:
            raise NoFreeBlocks(f"a step needs {need} more KV blocks, {self.n_free} are free")
        for q, s in zip(seqs, starts):
            self.reserve(q, s + T)
        device = self.layers[0].k.device
        N = max(self.blocks_for(s + T) for s in starts)
        rows = [self.tables[q][:N] for q in seqs]
        # Shorter rows are padded with their own first block: masked, any block would do.
        tables = torch.tensor([r + [r[0]] * (N - len(r)) for r in rows], device=device)  # (B, N)
        pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
        block = torch.gather(tables, 1, pos // self.block_size)  # (B, T)
        slots = block * self.block_size + pos % self.block_size  # (B, T)
        return PagedStep(
            list(self.layers), tables, slots, pos, self.group_cost, self.decode_attention
        )
