"""Generation for decoder-only and encoder-decoder models: prefill once, then one decode step per
token against the KV cache; sampling, stop tokens and strings, left-padded batches, streaming.

    prompts ─left pad─> ids (B, T0) ─prefill─> logits ─sample─> token ─decode_step─> logits ─> ...

Shapes: B batch, T0 longest prompt, N new tokens, S_max = T0 + N cache slots, V vocab_size.
"""

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from attnlab.components.embedding import check_token_ids
from attnlab.components.kv_cache import ModelCache
from attnlab.inference.sampling import SamplingConfig, sample

DEFAULT_SAMPLING = SamplingConfig()  # frozen, so one shared default instance is safe


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
    """The DecoderLM inside a decoder-only or encoder-decoder model."""
    return getattr(model, "decoder", model)


def prefill(
    model: nn.Module,
    ids: Tensor,
    cache: ModelCache,
    memory: Tensor | None = None,
    memory_mask: Tensor | None = None,
    last_only: bool = False,
) -> Tensor:
    """Run the prompt through the model, filling cache slots 0..T0-1. ids (B, T0) -> (B, T0, V),
    or (B, 1, V) with last_only (all generation needs: the next token's logits)."""
    slots = torch.arange(ids.shape[1], device=ids.device)
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


# As a decorator, no_grad wraps each resumption of the generator: a `with torch.no_grad()` inside
# it would leave gradients off in the caller's code between yields, and miss the prefill.
@torch.no_grad()
def stream_tokens(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    stop_tokens: Sequence[int] = (),
    seed: int | None = None,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
    step_fn: Callable | None = None,
) -> Iterator[Tensor]:
    """Yield each step's new tokens (B,) as soon as they are chosen.

    Rows that produced a stop token are finished: they keep yielding that stop token, and the
    loop ends when every row is finished or after `max_new_tokens`.

    Args:
        prompts: token ids per row (decoder-only), or the decoder start per row (encoder-decoder).
        source, source_mask: (B, M) encoder input and its mask, for encoder-decoder models.
        step_fn: replaces `decode_step` (e.g. a torch.compile'd one, such as
            `attnlab.inference.gemv.compile_decode_step(model)`), same signature.
    """
    decoder = decoder_of(model)
    device = decoder.head.weight.device
    ids, mask = left_pad(prompts, device=device)  # (B, T0); rejects empty prompts first
    check_token_ids(ids, decoder.head.out_features)  # padding is id 0, always valid
    B, T0 = ids.shape
    limit = decoder.positions.max_positions
    if limit is not None and T0 + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's {limit} positions (the size of its position table)"
        )
    memory = None if source is None else model.encode(source, source_mask)  # (B, M, C)
    key_valid = torch.cat([mask, mask.new_ones(B, max_new_tokens)], dim=1)  # (B, S_max)
    cache = ModelCache.for_decoder(decoder, key_valid, cross=memory is not None)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    logits = prefill(model, ids, cache, memory, source_mask, last_only=True)[:, -1]  # (B, V)
    # Padding must not count as "already generated" for the repetition penalty.
    history = torch.where(mask, ids, ids[:, -1:])  # (B, T0)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    step = step_fn or decode_step
    for i in range(max_new_tokens):
        token = sample(logits, sampling, history, gen)  # (B,)
        if len(stops):
            token = torch.where(done, history[:, -1], token)
            done = done | torch.isin(token, stops)
        history = torch.cat([history, token[:, None]], dim=1)
        yield token
        if (len(stops) and bool(done.all())) or i == max_new_tokens - 1:
            return
        slot = torch.tensor([T0 + i], device=device)
        logits = step(model, token[:, None], slot, cache, source_mask)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    seed: int | None = None,
    max_total_len: int | None = None,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
    on_token: Callable[[Tensor], None] | None = None,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt and return only the new tokens of each row.

    Args:
        stop_tokens: a row ends at (and keeps) the first of these.
        stop_strings: with `decode` (ids -> text), a row ends once its text contains one; the
            tokens are cut where the text first contains it (strings may span tokens).
        max_total_len: also stop when prompt + new tokens reach this length.
        on_token: called with each step's (B,) tokens as they come (streaming).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if stop_strings and decode is None:
        raise ValueError("stop_strings need a `decode` function (token ids -> text)")
    if max_total_len is not None:
        max_new_tokens = min(max_new_tokens, max_total_len - max(len(p) for p in prompts))
        if max_new_tokens < 1:
            raise ValueError(f"max_total_len={max_total_len} leaves no room after the prompt")
    rows: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for token in stream_tokens(
        model, prompts, max_new_tokens, sampling, stop_tokens, seed, source, source_mask
    ):
        if on_token is not None:
            on_token(token)
        for b, t in enumerate(token.tolist()):
            if finished[b]:
                continue
            rows[b].append(t)
            finished[b] = t in stop_tokens or _cut_at_stop_string(rows[b], stop_strings, decode)
        if all(finished):
            break
    return rows


def _cut_at_stop_string(row: list[int], stop_strings: Sequence[str], decode) -> bool:
    """If the row's text contains a stop string, drop the tokens after the one completing it."""
    if not stop_strings:
        return False
    if not any(s in decode(row) for s in stop_strings):
        return False
    while len(row) > 1 and any(s in decode(row[:-1]) for s in stop_strings):
        row.pop()  # the string was already complete without the last token
    return True


def generate_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    seed: int | None = None,
    stop_strings: Sequence[str] = (),
    num_beams: int = 1,
    length_penalty: float = 1.0,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Text in, text out: encode `prompt`, generate, and return only the new text.

    Decoder-only models continue the prompt. Encoder-decoder models read it as the source
    (encoded + <eos>, as Seq2SeqTask trains them) and decode from <bos>. Generation ends at the
    tokenizer's <eos>, after a stop string, or after `max_new_tokens`.

    Args:
        tokenizer: attnlab.tokenizer.Tokenizer (encode, decode, token_id).
        sampling, seed: how tokens are drawn (num_beams == 1).
        num_beams: > 1 runs beam search (deterministic: leave `sampling` at its defaults).
        length_penalty: beam search's length exponent.
        on_text: called with each new piece of text as it comes (streaming; num_beams == 1).

    Returns:
        the generated text, special tokens left out.
    """
    from attnlab.inference.beam import beam_search  # beam.py imports this module

    eos, bos = tokenizer.token_id("<eos>"), tokenizer.token_id("<bos>")
    stop_tokens = [] if eos is None else [eos]
    ids = tokenizer.encode(prompt)
    source = source_mask = None
    if hasattr(model, "encode"):  # encoder-decoder: the prompt is the source
        if eos is None or bos is None:
            raise ValueError("an encoder-decoder model needs <bos> and <eos> in the tokenizer")
        device = decoder_of(model).head.weight.device
        source = torch.tensor([ids + [eos]], device=device)  # (1, M)
        source_mask = torch.ones_like(source, dtype=torch.bool)
        ids = [bos]
    if num_beams != 1:
        if sampling != DEFAULT_SAMPLING or on_text is not None:
            raise ValueError(
                f"beam search (num_beams={num_beams}) is deterministic and returns "
                "its best hypothesis at the end: no sampling settings, no streaming"
            )
        tokens = beam_search(
            model,
            ids,
            num_beams,
            max_new_tokens,
            stop_tokens,
            length_penalty,
            source=source,
            source_mask=source_mask,
        ).tokens
        _cut_at_stop_string(tokens, stop_strings, tokenizer.decode)  # shortest prefix with one
        return tokenizer.decode(tokens)
    streamed: list[int] = []
    shown = ""

    def show(token: Tensor) -> None:
        nonlocal shown
        streamed.append(int(token[0]))
        text = tokenizer.decode(streamed)
        if not text.endswith("\ufffd"):  # wait until a multi-byte character is complete
            on_text(text[len(shown) :])
            shown = text

    rows = generate(
        model,
        [ids],
        max_new_tokens,
        sampling,
        stop_tokens,
        stop_strings,
        tokenizer.decode,
        seed,
        source=source,
        source_mask=source_mask,
        on_token=None if on_text is None else show,
    )
    text = tokenizer.decode(rows[0])
    if on_text is not None and text != shown:
        on_text(text[len(shown) :])  # whatever a stop string or an unfinished character held back
    return text
