"""Encoder-decoder: the 2017 Transformer and T5. The decoder cross-attends to the encoder output.

    src ids ─> Encoder ─> memory (B, M, C) ───────────────┐
    tgt ids ─> DecoderLM (causal self-attn, cross-attn to memory) ─> logits (B, T, V)

Shapes: B batch, M source length, T target length, C d_model, V vocab_size.
"""

from torch import Tensor, nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import Encoder


class EncoderDecoder(nn.Module):
    """An Encoder and a cross-attending DecoderLM (embeddings shared when the config ties them)."""

    def __init__(self, encoder: Encoder, decoder: DecoderLM):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src: (B, M) ids; src_mask: (B, M) True = real token -> memory (B, M, C)."""
        return self.encoder(src, src_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """tgt: (B, T) ids, memory: (B, M, C) -> logits (B, T, V). (Cached decoding calls
        `self.decoder` with a cache directly: see inference/generate.py.)"""
        return self.decoder(tgt, tgt_mask, memory=memory, memory_mask=src_mask)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """src: (B, M), tgt: (B, T) ids; masks True = real token -> logits (B, T, V)."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)
