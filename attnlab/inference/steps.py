"""The two steps every generation loop is made of: prefill a prompt batch into a preallocated KV
cache, then decode one token per row against it.

    prompts ─left pad─> ids (B, T0) ─prefill─> logits (B, V)     cache slots 0 .. T0-1 written
    token (B, 1) ─decode_step at slot s─> logits (B, V)          cache slot s written

`generate.py` (greedy and sampled decoding, streaming) and `beam.py` (beam search) are both loops
over these steps; neither imports the other's loop. `decode_step` has static shapes, so a
compiled one (`attnlab.inference.gemv.compile_decode_step`) can take its place.

What goes into the cache first depends on the model:

    decoder-only             [ prompt ]
    encoder-decoder          [ decoder start ]        + cross-attention K/V of the encoded source
    VisionEncoderDecoder     [ prompt ]               + cross-attention K/V of the encoded image
    PrefixVisionLM           [ image tokens | prompt ]  (`PrefixVisionLM.prefill`)
    PromptLearningLM         [ virtual tokens | prompt ]  (prefix / prompt tuning:
                                                       `write_prefix`, then the prompt)

Shapes: B batch, T0 longest prompt, N image tokens, S_max cache slots, M source length,
V vocab_size.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.components.kv_cache import ModelCache
from attnlab.models.vision import PrefixVisionLM


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, device=None
) -> tuple[Tensor, Tensor]:
    """Left-pad prompts so every row's last token is in the last column.

    Returns:
        ids (B, T0) int64, mask (B, T0) bool (True = real token).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (got an empty prompt)")
    T0 = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T0), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), T0), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, T0 - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, T0 - len(p) :] = True
    return ids, mask


def decoder_of(model: nn.Module) -> nn.Module:
    """The DecoderLM inside a decoder-only, encoder-decoder or vision-language model."""
    return getattr(model, "decoder", model)


def prefix_length(model: nn.Module) -> int:
    """How many cache slots a model fills before the prompt: N image tokens for an image-prefix
    model, P virtual tokens for a prefix- or prompt-tuned one, 0 otherwise."""
    if isinstance(model, PromptLearningLM):
        return model.num_virtual_tokens
    return model.encoder.patches.n_tokens if isinstance(model, PrefixVisionLM) else 0


def encode_source(
    model: nn.Module, source: Tensor | None, source_mask: Tensor | None
) -> Tensor | None:
    """The memory (B, M, C) that the decoder cross-attends to, or None (decoder-only and
    image-prefix models: an image prefix is written into the cache by `fill_cache` instead)."""
    if source is None or isinstance(model, PrefixVisionLM):
        return None
    return model.encode(source, source_mask)  # (B, M, C)


def prefill(
    model: nn.Module,
    ids: Tensor,
    cache: ModelCache,
    memory: Tensor | None = None,
    memory_mask: Tensor | None = None,
    last_only: bool = False,
    start: int = 0,
) -> Tensor:
    """Run the prompt through the model, filling cache slots start..start+T0-1 (after a prefix
    already in the cache). ids (B, T0) -> (B, T0, V), or (B, 1, V) with last_only (all
    generation needs: the next token's logits)."""
    slots = torch.arange(start, start + ids.shape[1], device=ids.device)
    return decoder_of(model)(
        ids, memory=memory, memory_mask=memory_mask, cache=cache, slots=slots, last_only=last_only
    )


def decode_step(
    model: nn.Module,
    token: Tensor,
    slot: Tensor,
    cache: ModelCache,
    memory_mask: Tensor | None = None,
) -> Tensor:
    """One new token per row at cache slot `slot` (shape (1,)). token (B, 1) -> logits (B, V).

    Static shapes (the cache is preallocated, `slot` is a tensor), so this can be compiled.
    """
    return decoder_of(model)(token, memory_mask=memory_mask, cache=cache, slots=slot)[:, -1]


def fill_cache(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    room: int,
    memory: Tensor | None = None,
    memory_mask: Tensor | None = None,
    images: Tensor | None = None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ModelCache, int]:
    """A new cache with the prompts prefilled and `room` free slots after them.

    Args:
        ids, mask: (B, T0) left-padded prompts and their mask (True = real token).
        room: slots left for new tokens (S_max = prefix + T0 + room).
        memory, memory_mask: (B, M, C) encoder output and (B, M) its mask (encoder-decoder).
        images: (B, C_in, H, W) for an image-prefix model (PrefixVisionLM), else None.
        kv_dtype: the cache's (None: the model's; torch.int8 / torch.float8_e4m3fn: quantized,
            components/kv_cache.py).

    Returns:
        logits (B, V) of each row's next token, the cache, and the slot of the first new token.
    """
    B, T0 = ids.shape
    N = prefix_length(model)
    key_valid = torch.cat([mask.new_ones(B, N), mask, mask.new_ones(B, room)], dim=1)  # (B, S_max)
    cache = ModelCache.for_decoder(
        decoder_of(model), key_valid, cross=memory is not None, dtype=kv_dtype
    )
    if isinstance(model, PromptLearningLM):  # the learned prefix first, then the prompt
        model.write_prefix(cache)
        logits = prefill(model, ids, cache, last_only=True, start=N)  # (B, 1, V)
    elif N:
        if images is None:
            raise ValueError("an image-prefix model needs its images: pass source=images")
        logits = model.prefill(images, ids, cache)  # (B, 1, V)
    else:
        logits = prefill(model, ids, cache, memory, memory_mask, last_only=True)  # (B, 1, V)
    return logits[:, -1], cache, N + T0
