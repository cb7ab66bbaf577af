"""Generation: greedy and sampled decoding, stop tokens and strings, left-padded batches,
streaming, and the context crop of models with a position table. Beam search (beam.py) is the
other loop over the same steps (steps.py): prefill once, then one decode step per token.

    prompts ─left pad─> ids (B, T0) ─prefill─> logits ─sample─> token ─decode_step─> logits ─> ...

Context crop (as nanoGPT's sampler): a model never sees more tokens than its position table
holds (learned or sinusoidal tables), or than `max_context` when given. When the text outgrows
that window, generation continues from its last `crop_to` tokens (default: the whole window):
the cache is refilled from them by a new prefill, so past the window each such step costs a
forward over `crop_to` tokens instead of one token (with the default, every token past the
window does; a smaller `crop_to` refills once every window - crop_to tokens). Rows of a batch
are cropped together, when the longest one fills the window.

Shapes: B batch, T0 longest prompt, N new tokens, S_max cache slots, V vocab_size.
"""

import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from attnlab.components.embedding import check_token_ids
from attnlab.inference.beam import beam_search
from attnlab.inference.sampling import SamplingConfig, sample
from attnlab.inference.steps import (
    decode_step,
    decoder_of,
    encode_source,
    fill_cache,
    left_pad,
    prefix_length,
)

DEFAULT_SAMPLING = SamplingConfig()  # frozen, so one shared default instance is safe


class ContextCropWarning(UserWarning):
    """Generation passed the model's position table and continues from a cropped context."""


def context_window(model: nn.Module, max_context: int | None) -> tuple[int | None, int | None]:
    """The most prompt + generated tokens `model` may see at once, and its position table's
    share of that limit (None where there is no limit)."""
    if max_context is not None and max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    table = decoder_of(model).positions.max_positions
    if table is not None:
        table -= prefix_length(model)  # image tokens take the first positions
    limits = [n for n in (table, max_context) if n is not None]
    return (min(limits) if limits else None), table


def plan_crop(
    model: nn.Module,
    T0: int,
    max_new_tokens: int,
    max_context: int | None,
    crop_to: int | None,
) -> tuple[int | None, int | None, str | None]:
    """(window, keep, notice): the most tokens fed at once, how many a refill keeps, and the
    notice to give if the position table is what forces the crop; (None, None, None) when
    prompt + new tokens fit."""
    window, table = context_window(model, max_context)
    if window is None or T0 + max_new_tokens <= window:
        return None, None, None
    keep = window if crop_to is None else crop_to
    if not 1 <= keep <= window:
        raise ValueError(f"crop_to must be in [1, {window}] (the context window), got {keep}")
    if prefix_length(model):
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"{window} text positions of this image-prefix model, which cannot crop its "
            "context (its image comes first): shorten the prompt or max_new_tokens"
        )
    notice = None
    if window == table and (max_context is None or max_context > table):
        notice = (
            f"prompt + new tokens pass the model's {table} positions: generation continues "
            f"from the last {keep} tokens (a forward over them at each crop)"
        )
    return window, keep, notice


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
    max_context: int | None = None,
    crop_to: int | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> Iterator[Tensor]:
    """Yield each step's new tokens (B,) as soon as they are chosen: the one generation loop.

    Rows that produced a stop token are finished: they keep yielding that stop token, and the
    loop ends when every row is finished or after `max_new_tokens`.

    Args:
        prompts: token ids per row (decoder-only), or the decoder start per row (encoder-decoder).
        source, source_mask: (B, M) encoder input and its mask (encoder-decoder models), or
            (B, C_in, H, W) images and None (vision-language models).
        step_fn: replaces `decode_step` (e.g. a torch.compile'd one, such as
            `attnlab.inference.compiled_step.compile_decode_step(model)`), same signature.
        max_context: feed the model at most this many tokens (default: its position table,
            unlimited without one); see the module docstring for the crop.
        crop_to: when the text outgrows the window, continue from its last `crop_to` tokens
            (1 <= crop_to <= window; default the window, as nanoGPT).
        on_notice: called with a one-line notice when the position table forces a crop (default:
            a ContextCropWarning).
    """
    decoder = decoder_of(model)
    device = decoder.head.weight.device
    ids, mask = left_pad(prompts, device=device)  # (B, T0); rejects empty prompts first
    check_token_ids(ids, decoder.head.out_features)  # padding is id 0, always valid
    B, T0 = ids.shape
    window, keep, notice = plan_crop(model, T0, max_new_tokens, max_context, crop_to)

    def notify() -> None:  # the crop notice, once
        nonlocal notice
        if notice is not None:
            if on_notice is None:
                warnings.warn(notice, ContextCropWarning, stacklevel=3)
            else:
                on_notice(notice)
            notice = None

    memory = encode_source(model, source, source_mask)  # (B, M, C) or None
    history = torch.where(mask, ids, ids[:, -1:])  # (B, T0) padding -> a token already there
    seen = mask  # (B, T) False = left padding
    if window is not None and T0 > window:
        ids, mask = ids[:, -keep:], mask[:, -keep:]
        notify()
    room = max_new_tokens if window is None else window - ids.shape[1]
    logits, cache, slot = fill_cache(model, ids, mask, room, memory, source_mask, source)
    S_max = cache.key_valid.shape[1]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    step = step_fn or decode_step
    for i in range(max_new_tokens):
        token = sample(logits, sampling, history, gen)  # (B,)
        if len(stops):
            token = torch.where(done, history[:, -1], token)
            done = done | torch.isin(token, stops)
        history = torch.cat([history, token[:, None]], dim=1)  # (B, T0 + i + 1)
        seen = torch.cat([seen, seen.new_ones(B, 1)], dim=1)
        yield token
        if (len(stops) and bool(done.all())) or i == max_new_tokens - 1:
            return
        if slot < S_max:
            at = torch.tensor([slot], device=device)
            logits = step(model, token[:, None], at, cache, source_mask)  # (B, V)
            slot += 1
        else:  # the cache is full: refill it from the last `keep` tokens
            notify()
            logits, cache, slot = fill_cache(
                model, history[:, -keep:], seen[:, -keep:], window - keep, memory, source_mask
            )


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
    step_fn: Callable | None = None,
    max_context: int | None = None,
    crop_to: int | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt and return only the new tokens of each row.

    Args:
        stop_tokens: a row ends at (and keeps) the first of these.
        stop_strings: with `decode` (ids -> text), a row ends once its text contains one; the
            tokens are cut where the text first contains it (strings may span tokens).
        max_total_len: also stop when prompt + new tokens reach this length.
        on_token: called with each step's (B,) tokens as they come (streaming).
        source, source_mask, step_fn, max_context, crop_to, on_notice: see `stream_tokens`.
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
    stream = stream_tokens(
        model,
        prompts,
        max_new_tokens,
        sampling,
        stop_tokens,
        seed,
        source,
        source_mask,
        step_fn,
        max_context,
        crop_to,
        on_notice,
    )
    for token in stream:
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
    on_notice: Callable[[str], None] | None = None,
    stop_tokens: Sequence[int] = (),
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
        on_notice: called with a one-line notice if the context is cropped (see
            `stream_tokens`; default a ContextCropWarning).
        stop_tokens: more token ids that end generation besides <eos> (a chat template's end
            of turn).

    Returns:
        the generated text, special tokens left out.
    """
    eos, bos = tokenizer.token_id("<eos>"), tokenizer.token_id("<bos>")
    stop_tokens = ([] if eos is None else [eos]) + list(stop_tokens)
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
            [ids],
            num_beams,
            max_new_tokens,
            stop_tokens,
            length_penalty,
            source=source,
            source_mask=source_mask,
        )[0][0].tokens
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
        on_notice=on_notice,
    )
    text = tokenizer.decode(rows[0])
    if on_text is not None and text != shown:
        on_text(text[len(shown) :])  # whatever a stop string or an unfinished character held back
    return text
