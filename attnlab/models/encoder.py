"""Encoder: bidirectional blocks over token embeddings (BERT, the 2017 encoder, T5's encoder),
with the heads BERT puts on top: masked-LM and sequence classification.

Shapes: B batch, T length, C d_model, V vocab_size, N labels.
"""

import torch
from torch import Tensor, nn

from attnlab.components.context import AttentionContext
from attnlab.components.hooks import HookPoint
from attnlab.components.masks import (
    MaskMod,
    custom_attention_mask,
    is_mask_mod,
    mask_from_mod,
    padding_mask,
    uses_flex,
)
from attnlab.components.positions.base import PositionScheme


class Encoder(nn.Module):
    """Token (+ segment) embeddings with positions, then bidirectional blocks.

    Args:
        embed: TokenEmbedding.  positions: the position scheme.  blocks: EncoderBlocks.
        norm: final norm (pre-norm stacks) or Identity.
        type_embed: segment embeddings (BERT) or None.
        embed_norm: norm after embedding, or Identity.
        dropout: on the embeddings.
    """

    def __init__(
        self,
        embed: nn.Embedding,
        positions: PositionScheme,
        blocks: list[nn.Module],
        norm: nn.Module,
        type_embed: nn.Embedding | None = None,
        embed_norm: nn.Module | None = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed, self.positions, self.type_embed = embed, positions, type_embed
        self.embed_norm = nn.Identity() if embed_norm is None else embed_norm
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.drop = nn.Dropout(dropout)
        self.hook_embed, self.hook_final_norm = HookPoint(), HookPoint()  # components/hooks.py
        self.hook_tokens = HookPoint()  # the ids
        if type_embed is not None:  # the token-type ids and their embedding (BERT)
            self.hook_types, self.hook_type_embed = HookPoint(), HookPoint()

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        attn_mask: Tensor | MaskMod | None = None,
    ) -> Tensor:
        """ids: (B, T); attention_mask: (B, T) True = real token -> hidden states (B, T, C).

        attn_mask: bool (T, T) or (B, T, T), True = query i may attend to key j, in place of
        full bidirectional attention (e.g. a prefix-LM mask); combined with `attention_mask`.
        Or a mask_mod (b, h, i, j) -> bool, e.g. `document_mask_mod(doc_ids, causal=False)`:
        a BlockMask when every layer uses backend "flex", else evaluated into a dense mask.
        """
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        if is_mask_mod(attn_mask):
            mask = mask_from_mod(attn_mask, B, T, attention_mask, uses_flex(self), ids.device)
        elif attn_mask is not None:
            mask = custom_attention_mask(attn_mask, B, T, attention_mask)  # (T,T) / (B,1,T,T)
        else:
            mask = None if attention_mask is None else padding_mask(attention_mask)  # (B,1,1,T)
        ctx = AttentionContext(  # once per forward, for every block
            mask=mask,
            positions=self.positions.prepare(pos, pos, bound=T),
        )
        x = self.hook_embed(self.embed(self.hook_tokens(ids)))  # (B, T, C)
        x = self.positions.embed(x, pos)  # (B, T, C)
        if self.type_embed is not None:
            types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
            x = x + self.hook_type_embed(self.type_embed(self.hook_types(types)))  # (B, T, C)
        x = self.drop(self.embed_norm(x))
        for block in self.blocks:
            x = block(x, ctx)  # (B, T, C)
        return self.hook_final_norm(self.norm(x))  # (B, T, C)


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense -> GELU -> norm -> decoder (tied to the embedding) + bias."""

    def __init__(self, d_model: int, vocab_size: int, norm: nn.Module, activation):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.act, self.norm = activation, norm
        self.decoder = nn.Linear(d_model, vocab_size)
        self.hook_dense, self.hook_transformed = HookPoint(), HookPoint()  # components/hooks.py
        self.hook_logits = HookPoint()

    def forward(self, h: Tensor) -> Tensor:
        h = self.hook_transformed(self.norm(self.act(self.hook_dense(self.dense(h)))))  # (B, T, C)
        return self.hook_logits(self.decoder(h))  # (B, T, V)


class EncoderForMLM(nn.Module):
    """Encoder + masked-LM head: the BERT pre-training model (logits for every position)."""

    def __init__(self, encoder: Encoder, head: MLMHead):
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """ids: (B, T) -> logits (B, T, V)."""
        return self.head(self.encoder(ids, attention_mask, token_type_ids))


class EncoderForClassification(nn.Module):
    """Encoder + BERT pooler (tanh dense on the first token) + a linear classifier.

    Args:
        encoder: an Encoder.  d_model: C.  n_labels: N.  dropout: before the classifier.
    """

    def __init__(self, encoder: Encoder, d_model: int, n_labels: int, dropout: float = 0.0):
        super().__init__()
        if n_labels < 1:
            raise ValueError(f"n_labels must be >= 1, got {n_labels}")
        self.encoder = encoder
        self.pooler = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, n_labels)

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """ids: (B, T) -> class logits (B, N)."""
        h = self.encoder(ids, attention_mask, token_type_ids)  # (B, T, C)
        pooled = torch.tanh(self.pooler(self.summary(h, attention_mask)))  # (B, C)
        return self.classifier(self.drop(pooled))  # (B, N)

    def summary(self, h: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The vector the pooler reads: the first ([CLS]) token's, (B, T, C) -> (B, C)."""
        return h[:, 0]
