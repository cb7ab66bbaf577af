"""Encoder-decoder: the 2017 Transformer and T5. The decoder cross-attends to the encoder output.

    src ids ─> Encoder ─> memory (B, M, C) ───────────────┐
    tgt ids ─> DecoderLM (causal self-attn, cross-attn to memory) ─> logits (B, T, V)

Shapes: B batch, M source length, T target length, C d_model, V vocab_size.
"""

from torch import Tensor, nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import Encoder


class EncoderDecoder(nn.Module):
    """An Encoder and a cross-attending DecoderLM (embeddings shared when the config ties them).

    Masks use the names of the other families and of `transformers`: `attention_mask` is the
    source's (B, M), `decoder_attention_mask` the target's (B, T); True = real token.
    """

    def __init__(self, encoder: Encoder, decoder: DecoderLM):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def encode(self, src: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """src: (B, M) ids; attention_mask: (B, M) True = real token -> memory (B, M, C)."""
        return self.encoder(src, attention_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        attention_mask: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """tgt: (B, T) ids, memory: (B, M, C) -> logits (B, T, V). attention_mask is the
        memory's (B, M). (Cached decoding calls `self.decoder` with a cache directly: see
        inference/generate.py.)"""
        return self.decoder(tgt, decoder_attention_mask, memory=memory, memory_mask=attention_mask)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        attention_mask: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """src: (B, M), tgt: (B, T) ids -> logits (B, T, V).

        Args:
            src: (B, M) source ids.  tgt: (B, T) target ids (teacher-forced).
            attention_mask: (B, M) True = real source token; None = no padding.
            decoder_attention_mask: (B, T) True = real target token; None = no padding.
        """
        memory = self.encode(src, attention_mask)  # (B, M, C)
        return self.decode(
            tgt,
            memory,
            attention_mask=attention_mask,
            decoder_attention_mask=decoder_attention_mask,
        )
