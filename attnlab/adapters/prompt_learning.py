"""Prefix tuning and prompt tuning: a frozen decoder LM steered by P learned vectors placed in
front of every input, as `peft` defines them (its PrefixTuningConfig, PromptTuningConfig).

Prefix tuning (Li & Liang 2021, arXiv:2101.00190): every attention layer sees P learned key and
value vectors before the input's own, so each layer attends to a "virtual" prefix that no token
produced. Optimising the prefix directly is unstable (the paper's section 4.3), so it may be
reparametrised through an MLP: P embeddings (K*D) -> Linear(K*D, h) -> tanh -> Linear(h,
L * 2 * K*D) (`prefix_projection`). Only the MLP's output matters at inference: it is what
is saved.

Prompt tuning (Lester et al. 2021, arXiv:2104.08691): P learned input embeddings ("soft prompt",
virtual tokens) go in front of the input's token embeddings; the frozen model turns them into
keys and values as it would a prompt's.

Both are a prefix of the KV cache (components/kv_cache.py), and that is how they are run here,
in training and in generation alike: a cache whose first P slots hold the prefix, then the
input's tokens in the slots after it.

    cache slots        0 .. P-1                             P .. P+T-1
    prefix tuning      the learned K, V of each layer       the input's K, V
    prompt tuning      K, V the model makes of the soft prompt

`write_prefix` fills slots 0..P-1 (differentiably: the prefix trains through the cache);
`forward` runs the decoder on the input at slots P.. of a fresh cache; generation
(inference/steps.py `fill_cache`) writes the prefix, then prefills the prompt after it, and
every decode step reads the prefix from the cache with nothing else to know. The input's
tokens sit at positions P, P+1, ... as in peft (HF counts the virtual tokens among the past).

The prefix is kept in peft's layout: (P, L * 2 * K*D), layer i's keys at [2i * K*D, (2i+1) *
K*D) and values after them, each K kv heads of D (GQA: the kv heads, peft's #1901).

Shapes: B batch, T tokens, P virtual tokens, L layers, K kv heads, D head_dim, C d_model.
"""

from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.components.attention import Attention
from attnlab.components.context import AttentionContext
from attnlab.components.kv_cache import ModelCache

Method = Literal["prefix", "prompt"]
METHODS = ("prefix", "prompt")


class PromptLearningLM(nn.Module):
    """A frozen DecoderLM with a learned prefix of P virtual tokens (prefix or prompt tuning).

    Args:
        decoder: the DecoderLM (frozen here).
        method: "prefix" (learned keys and values per layer) or "prompt" (learned embeddings).
        num_virtual_tokens: P.
        prefix_projection: (prefix) train the prefix through an MLP of this hidden width
            (peft's encoder_hidden_size); 0 trains the prefix itself.

    Attributes:
        embedding: nn.Embedding (P, L * 2 * K*D) the prefix (prefix tuning without MLP),
            (P, K*D) the MLP's inputs, or (P, C) the soft prompt.
        transform: the MLP (prefix tuning with prefix_projection), else None.
    """

    def __init__(
        self,
        decoder: nn.Module,
        method: Method,
        num_virtual_tokens: int,
        prefix_projection: int = 0,
    ):
        super().__init__()
        if method not in METHODS:
            raise ValueError(
                f"prompt-learning method must be one of {list(METHODS)}, not {method!r}"
            )
        if num_virtual_tokens < 1:
            raise ValueError(f"num_virtual_tokens must be >= 1, got {num_virtual_tokens}")
        if prefix_projection and method != "prefix":
            raise ValueError("prefix_projection is prefix tuning's MLP; prompt tuning has none")
        attns = [blk.self_attn for blk in decoder.blocks]
        if method == "prefix" and not all(type(a) is Attention for a in attns):
            raise ValueError("prefix tuning needs plain multi-head attention (MLA caches latents)")
        self.decoder = decoder.requires_grad_(False)
        self.method, self.num_virtual_tokens = method, num_virtual_tokens
        device = decoder.embed.weight.device
        self.n_kv_heads, self.head_dim = attns[0].n_kv_heads, attns[0].head_dim
        # peft's token_dim: d_model for a soft prompt, K*D (the kv heads' width) for a prefix
        dim = (
            decoder.embed.weight.shape[1] if method == "prompt" else self.n_kv_heads * self.head_dim
        )
        self.transform = None
        if prefix_projection:  # P embeddings (K*D) -> Linear -> tanh -> Linear -> the prefix
            h, width = prefix_projection, len(attns) * 2 * dim
            self.embedding = nn.Embedding(num_virtual_tokens, dim, device=device)
            self.transform = nn.Sequential(
                nn.Linear(dim, h, device=device), nn.Tanh(), nn.Linear(h, width, device=device)
            )
        else:  # N(0, 1), as peft's
            width = dim if method == "prompt" else len(attns) * 2 * dim
            self.embedding = nn.Embedding(num_virtual_tokens, width, device=device)

    def prefix(self) -> Tensor:
        """The prefix as peft saves it ("prompt_embeddings"): (P, L * 2 * K*D) keys and values
        (prefix tuning, through the MLP if there is one) or (P, C) embeddings (prompt tuning)."""
        x = self.embedding.weight
        return x if self.transform is None else self.transform(x)

    def write_prefix(self, cache, slots: Tensor | None = None) -> None:
        """Fill the first P positions of every row of `cache` with the prefix: slots 0..P-1
        of a ModelCache, or the (B, P) pool slots `slots` of a paged cache's step (the serve
        engine's, components/paged_kv_cache.py)."""
        P = self.num_virtual_tokens
        if slots is None:
            slots = torch.arange(P, device=self.embedding.weight.device)
        B = slots.shape[0] if slots.dim() == 2 else cache.key_valid.shape[0]
        if self.method == "prefix":
            L, K, D = len(cache.layers), self.n_kv_heads, self.head_dim
            kv = self.prefix().view(P, L, 2, K, D).permute(1, 2, 3, 0, 4)  # (L, 2, K, P, D)
            for layer, (k, v) in zip(cache.layers, kv):
                layer.update(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), slots)
            return
        dec = self.decoder  # prompt tuning: the soft prompt through the model, as a prompt is
        pos, k_pos, bound, mask = cache.positions_and_mask(slots, dec.window)
        terms = dec.positions.prepare(pos, k_pos, bound)
        ctx = AttentionContext(mask=mask, positions=terms, slots=slots)
        x = self.prefix().to(dec.embed.weight.dtype).expand(B, -1, -1)  # (B, P, C)
        dec.run_blocks(dec.drop(dec.positions.embed(x, pos)), ctx, cache)

    def forward(
        self, ids: Tensor, attention_mask: Tensor | None = None, *, last_only: bool = False
    ) -> Tensor:
        """Logits of the input's tokens, each seeing the prefix first.

        Args:
            ids: (B, T).  attention_mask: (B, T) True = real token; None = no padding.
            last_only: the last position's logits only.

        Returns:
            (B, T, V) logits (the virtual tokens have none), or (B, 1, V).
        """
        (B, T), P = ids.shape, self.num_virtual_tokens
        valid = ids.new_ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask
        cache = ModelCache.for_decoder(self.decoder, torch.cat([valid.new_ones(B, P), valid], 1))
        self.write_prefix(cache)
        slots = torch.arange(P, P + T, device=ids.device)  # the input after the prefix
        return self.decoder(ids, cache=cache, slots=slots, last_only=last_only)

    def extra_repr(self) -> str:
        mlp = f", prefix_projection={self.transform[0].out_features}" if self.transform else ""
        return f"method={self.method!r}, num_virtual_tokens={self.num_virtual_tokens}{mlp}"
