"""Vision-language models: a small ViT encoder and two ways of joining it to a text decoder.

    (a) cross-attention (encoder-decoder style: captioning, VQA; Flamingo-like in spirit)

        image ─> VisionEncoder ─> memory (B, N, C) ────────────────┐
        text  ─> DecoderLM (causal self-attn, cross-attn to memory) ─> logits (B, T, V)

    (b) image prefix (PaliGemma, and VLA models such as RT-2 / OpenVLA that decode actions)

        [ image tokens (B, N, C) ][ text / action tokens (B, T, C) ] ─> the decoder's own blocks
         prefix-LM mask: image tokens see each other fully; text sees every image token and the
         text before it (causal). Logits are read at the text positions only.

            keys ->  i i i t t t          i = image token, t = text token
            i        # # # . . .
            i        # # # . . .
            i        # # # . . .
            t        # # # # . .
            t        # # # # # .
            t        # # # # # #

Both models take `forward(images, ids, attention_mask)` and return text logits, so one task trains
either. The ViT is EncoderBlocks over patch embeddings (Dosovitskiy et al. 2021).

Shapes: B batch, N image tokens, T text tokens, C d_model, V vocab_size.
"""

import torch
from torch import Tensor, nn

from attnlab.components.context import AttentionContext
from attnlab.components.masks import padding_mask, prefix_lm_mask
from attnlab.components.vision import PatchEmbedding
from attnlab.models.decoder import DecoderLM


class VisionEncoder(nn.Module):
    """ViT: patch embedding (with positions), bidirectional EncoderBlocks, final norm.

    Args:
        patches: a PatchEmbedding.  blocks: EncoderBlocks (may be empty).
        norm: final norm (pre-norm stacks) or Identity.  dropout: on the patch embeddings.
    """

    def __init__(
        self,
        patches: PatchEmbedding,
        blocks: list[nn.Module],
        norm: nn.Module,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.patches = patches
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.drop = nn.Dropout(dropout)

    def forward(self, images: Tensor) -> Tensor:
        """images: (B, C_in, H, W) -> image features (B, N, C)."""
        x = self.drop(self.patches(images))  # (B, N, C)
        for block in self.blocks:
            x = block(x)  # no mask: every patch sees every patch
        return self.norm(x)  # (B, N, C)


class VisionEncoderDecoder(nn.Module):
    """(a) A ViT and a DecoderLM whose blocks cross-attend to the image features.

    `encode(images)` has the signature of `EncoderDecoder.encode`, so cached decoding works
    unchanged: `attnlab.inference.generate.generate(model, prompts, config, source=images)`.
    """

    def __init__(self, encoder: VisionEncoder, decoder: DecoderLM):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def encode(self, images: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """images: (B, C_in, H, W) -> memory (B, N, C). `attention_mask` must be None (no padded
        images); it is there so this has `EncoderDecoder.encode`'s signature."""
        if attention_mask is not None:
            raise ValueError("images have no padding: pass source_mask=None")
        return self.encoder(images)

    def forward(self, images: Tensor, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """images: (B, C_in, H, W), ids: (B, T), attention_mask: (B, T) -> logits (B, T, V)."""
        return self.decoder(ids, attention_mask, memory=self.encode(images))


class PrefixVisionLM(nn.Module):
    """(b) Image tokens as a prefix of the decoder's sequence, under a prefix-LM mask.

    Args:
        encoder: the ViT.  projector: Linear(C, C) from image features to the decoder's
            embedding space (LLaVA's connector).  decoder: a DecoderLM without cross-attention;
            its embedding, positions, blocks, norm and head are used here.
    """

    def __init__(self, encoder: VisionEncoder, projector: nn.Module, decoder: DecoderLM):
        super().__init__()
        self.encoder, self.projector, self.decoder = encoder, projector, decoder

    def forward(
        self,
        images: Tensor,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor:
        """Text logits, every text token conditioned on the whole image.

        Args:
            images: (B, C_in, H, W).  ids: (B, T) text token ids.
            attention_mask: (B, T) True = real text token (right padding); None = no padding.
            return_hidden: return the final hidden states of all N + T tokens instead.

        Returns:
            (B, T, V) logits at the text positions (or (B, N + T, C) hidden states).
        """
        dec = self.decoder
        img = self.projector(self.encoder(images))  # (B, N, C)
        B, N, _ = img.shape
        x = torch.cat([img, dec.embed(ids)], dim=1)  # (B, N+T, C)
        L = x.shape[1]
        pos = torch.arange(L, device=ids.device)  # decoder positions run over image, then text
        mask = prefix_lm_mask(L, N, device=ids.device)  # (L, L)
        if attention_mask is not None:
            valid = torch.cat([attention_mask.bool().new_ones(B, N), attention_mask.bool()], 1)
            mask = mask & padding_mask(valid)  # (B, 1, L, L)
        ctx = AttentionContext(mask=mask, positions=dec.positions.prepare(pos, pos, bound=L))
        x = dec.drop(dec.positions.embed(x, pos))
        x = dec.run_blocks(x, ctx)  # (B, L, C)
        if return_hidden:
            return dec.norm(x)
        return dec.logits(x[:, N:])  # (B, T, V)

    def prefill(self, images: Tensor, ids: Tensor, cache) -> Tensor:
        """Generation's first step: the image tokens and the prompt into a KV cache, in one pass.

        The cache (components/kv_cache.py) holds the N image tokens in slots 0..N-1, then the
        prompt (left padding marked False in `cache.key_valid`), then room for new tokens. Its
        positions count real tokens, so they run over image, then text, as in `forward`. Tokens
        after the prompt are decoded by `self.decoder` alone: its cached mask (a query sees the
        slots up to its own) is the prefix-LM mask past the image.

        Args:
            images: (B, C_in, H, W).  ids: (B, T0) prompt ids.  cache: a ModelCache of S_max slots.

        Returns:
            (B, 1, V) logits of the last prompt position.
        """
        dec = self.decoder
        img = self.projector(self.encoder(images))  # (B, N, C)
        N = img.shape[1]
        x = torch.cat([img, dec.embed(ids)], dim=1)  # (B, L, C), L = N + T0
        slots = torch.arange(x.shape[1], device=ids.device)  # (L,)
        pos, k_pos = cache.pos[:, slots], cache.pos  # (B, L), (B, S_max)
        x = dec.drop(dec.positions.embed(x, pos))
        k = torch.arange(cache.key_valid.shape[1], device=ids.device)  # (S_max,)
        mask = (k[None, :] <= slots[:, None]) | (k[None, :] < N)  # (L, S_max) prefix-LM
        mask = mask & cache.key_valid[:, None, None, :]  # (B, 1, L, S_max)
        terms = dec.positions.prepare(pos, k_pos, bound=k_pos.shape[1])
        ctx = AttentionContext(mask=mask, positions=terms, slots=slots)
        x = dec.run_blocks(x, ctx, cache)  # (B, L, C)
        return dec.logits(x[:, -1:])  # (B, 1, V)
