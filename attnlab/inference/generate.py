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
from dataclasses import replace

import torch
from torch import Tensor, nn

from attnlab.components.embedding import check_token_ids
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.constraints import Matcher, accepts, banned_by, check_room
from attnlab.inference.sampling import SamplingConfig, SamplingRows, TokenCounts, sample
from attnlab.inference.speculative import Speculative
from attnlab.inference.steps import (
    decode_step,
    decoder_of,
    encode_source,
    fill_cache,
    left_pad,
    prefix_length,
)
from attnlab.inference.text import IncrementalDecoder, StopStrings, shortest_with_stop
from attnlab.models.vision import PrefixVisionLM

DEFAULT_SAMPLING = SamplingConfig()  # frozen, so one shared default instance is safe
DEFAULT_GENERATION = GenerationConfig()


class ContextCropWarning(UserWarning):
    """Generation passed the model's position table and continues from a cropped context."""


class CutConstraintWarning(UserWarning):
    """max_new_tokens ended a constrained text before the constraint accepted it."""


def context_window(model: nn.Module, max_context: int | None) -> tuple[int | None, int | None]:
    """The most prompt + generated tokens `model` may see at once, and its position table's
    share of that limit (None where there is no limit)."""
    if max_context is not None and max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    table = decoder_of(model).positions.max_positions
    if table is not None:
        table -= prefix_length(model)  # image or virtual tokens take the first positions
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
    if isinstance(model, PrefixVisionLM):
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
    config: GenerationConfig = DEFAULT_GENERATION,
    *,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
    step_fn: Callable | None = None,
    on_notice: Callable[[str], None] | None = None,
    tokenizer=None,
) -> Iterator[Tensor]:
    """Yield each step's new tokens (B,) as soon as they are chosen: the one generation loop.

    A row that produced one of `config.stop_tokens` keeps yielding it; the loop ends when every
    row has, or after `config.max_new_tokens`. Stop strings are the callers' (`generate`).

    Args:
        prompts: token ids per row (decoder-only), or the decoder start per row (encoder-decoder).
        config: what to generate (sampling, seed, stop tokens, max_context, crop_to, ...).
        source, source_mask: (B, M) encoder input and its mask (encoder-decoder models), or
            (B, C_in, H, W) images and None (vision-language models).
        step_fn: replaces `decode_step`, same signature (`compiled_step.compile_decode_step`).
        on_notice: gets the one-line notice of a crop the position table forces (default: a
            ContextCropWarning).
        tokenizer: the model's Tokenizer, for `config.constraint` (each row gets its own
            Matcher, whose mask bans tokens as the stop tokens are banned before min_new_tokens).
    """
    decoder = decoder_of(model)
    device = decoder.head.weight.device
    ids, mask = left_pad(prompts, device=device)  # (B, T0); rejects empty prompts first
    check_token_ids(ids, decoder.head.out_features)  # padding is id 0, always valid
    B, T0 = ids.shape
    n_new = config.new_tokens_for(T0)
    window, keep, notice = plan_crop(model, T0, n_new, config.max_context, config.crop_to)
    notice = _Notice(notice, on_notice)
    V = decoder.head.out_features
    matchers = row_matchers(config, tokenizer, B, V, n_new)  # before the prefill: may refuse
    memory = encode_source(model, source, source_mask)  # (B, M, C) or None
    history = torch.where(mask, ids, ids[:, -1:])  # (B, T0) padding -> a token already there
    seen = mask  # (B, T) False = left padding
    if window is not None and T0 > window:
        ids, mask = ids[:, -keep:], mask[:, -keep:]
        notice.give()
    room = n_new if window is None else window - ids.shape[1]
    kv = config.kv_cache_dtype
    logits, cache, slot = fill_cache(model, ids, mask, room, memory, source_mask, source, kv)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(config.stop_tokens, dtype=torch.long, device=device)
    rows = SamplingRows.stack([config.sampling] * B, V, device)
    counts = TokenCounts.of_prompts(history, V) if rows.needs_counts else None
    stop_mask = torch.zeros(V, dtype=torch.bool, device=device).index_fill(0, stops, True)
    gen = None if config.seed is None else torch.Generator(device=device).manual_seed(config.seed)
    step = step_fn or decode_step
    for i in range(n_new):
        banned = stop_mask if i < config.min_new_tokens else None
        constrained = banned_by(matchers, device)  # (B, V) or None
        if constrained is not None:
            banned = constrained if banned is None else constrained | banned
        token = sample(logits, rows, counts, gen, banned)  # (B,)
        if config.constraint is not None:
            for m, t in zip(matchers, token.tolist()):
                m.advance(t)
        if counts is not None:
            counts.add(token)
        if len(stops):
            token = torch.where(done, history[:, -1], token)
            done = done | torch.isin(token, stops)
        history = torch.cat([history, token[:, None]], dim=1)  # (B, T0 + i + 1)
        seen = torch.cat([seen, seen.new_ones(B, 1)], dim=1)
        yield token
        if (len(stops) and bool(done.all())) or i == n_new - 1:
            return
        if slot < cache.key_valid.shape[1]:  # room left in the cache
            at = torch.tensor([slot], device=device)
            logits = step(model, token[:, None], at, cache, source_mask)  # (B, V)
            slot += 1
        else:  # the cache is full: refill it from the last `keep` tokens
            notice.give()
            logits, cache, slot = fill_cache(
                model,
                history[:, -keep:],
                seen[:, -keep:],
                window - keep,
                memory,
                source_mask,
                kv_dtype=kv,
            )


def row_matchers(
    config: GenerationConfig, tokenizer, B: int, V: int, n_new: int
) -> list[Matcher | None]:
    """One Matcher per row for `config.constraint` (None per row without one); a ValueError
    when no text the constraint accepts fits in the `n_new` tokens (constraints.check_room)."""
    if config.constraint is None:
        return [None] * B
    if tokenizer is None:
        raise ValueError("a constraint needs the tokenizer: pass tokenizer= to generate")
    check_room(config.constraint, tokenizer, n_new, "max_new_tokens")
    return [Matcher(config.constraint, tokenizer, config.stop_tokens, V) for _ in range(B)]


def token_stream(model, prompts, config, speculative: Speculative | None, **kw):
    """Each step's tokens: `stream_tokens(model, prompts, config, **kw)`, or drafted and
    verified by `speculative` (which takes no constraint)."""
    if speculative is None:
        return stream_tokens(model, prompts, config, **kw)
    if config.constraint is not None:
        raise ValueError("speculative decoding takes no constraint: leave out one of the two")
    return speculative.stream(model, prompts, config)


class _Notice:
    """A notice, given once: to `on_notice`, or as a warning of `category`."""

    def __init__(
        self,
        message: str | None,
        on_notice: Callable[[str], None] | None,
        category: type[Warning] = ContextCropWarning,
    ):
        self.message, self.on_notice, self.category = message, on_notice, category

    def give(self) -> None:
        if self.message is None:
            return
        if self.on_notice is None:
            warnings.warn(self.message, self.category, stacklevel=3)
        else:
            self.on_notice(self.message)
        self.message = None


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = DEFAULT_GENERATION,
    *,
    decode: Callable[[list[int]], str] | None = None,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    step_fn: Callable | None = None,
    on_notice: Callable[[str], None] | None = None,
    speculative: Speculative | None = None,
    tokenizer=None,
) -> list[list[int]]:
    """Generate up to `config.max_new_tokens` per prompt and return only the new tokens of each
    row. A row ends at (and keeps) the first of `config.stop_tokens`; with `decode` (ids ->
    text), also once its text contains one of `config.stop_strings`, its tokens cut after the
    one that completes it (strings may span tokens).

    Args:
        decode: token ids -> text, for stop strings (detokenized incrementally, text.py).
        on_token: called with each step's (B,) tokens as they come (streaming).
        source, source_mask, step_fn, on_notice, tokenizer: see `stream_tokens`.
        speculative: draft and verify instead of one decode step per token (speculative.py;
            one prompt, a decoder-only model); the same tokens when greedy.
    """
    if config.stop_strings and decode is None:
        raise ValueError("stop_strings need a `decode` function (token ids -> text)")
    texts = [IncrementalDecoder(decode) for _ in prompts] if config.stop_strings else None
    stops = [StopStrings(config.stop_strings) for _ in prompts]
    rows: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stream = token_stream(
        model,
        prompts,
        config,
        speculative,
        source=source,
        source_mask=source_mask,
        step_fn=step_fn,
        on_notice=on_notice,
        tokenizer=tokenizer,
        **({} if step_fn is None else {"step_fn": step_fn}),
    )
    for token in stream:
        if on_token is not None:
            on_token(token)
        for b, t in enumerate(token.tolist()):
            if finished[b]:
                continue
            rows[b].append(t)
            finished[b] = t in config.stop_tokens
            if texts is not None and not finished[b]:
                texts[b].push(t)
                if stops[b].find(texts[b].text) is not None:  # cut after the completing token
                    finished[b] = shortest_with_stop(rows[b], config.stop_strings, decode)
        if all(finished):
            break
    return rows


def generate_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    config: GenerationConfig = DEFAULT_GENERATION,
    *,
    max_new_tokens: int | None = None,
    on_text: Callable[[str], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    speculative: Speculative | None = None,
    step_fn: Callable | None = None,
) -> str:
    """Text in, text out: encode `prompt`, generate, and return only the new text.

    Decoder-only models continue the prompt. Encoder-decoder models read it as the source
    (encoded + <eos>, as Seq2SeqTask trains them) and decode from <bos>. Generation ends at the
    tokenizer's <eos> or one of `config.stop_tokens` (a chat template's end of turn), after the
    token that completes a stop string (kept in the text), or after `config.max_new_tokens`.
    `config.num_beams` > 1 runs beam search (deterministic: leave `config.sampling` alone).

    Args:
        tokenizer: attnlab.tokenizer.Tokenizer (encode, decode, token_id).
        max_new_tokens: shorthand for `config.max_new_tokens` (the one setting most calls
            change: `generate_text(model, tok, "def ", max_new_tokens=60)`).
        on_text: called with each new piece of text as it comes (streaming; num_beams == 1);
            the pieces add up to the result.
        on_notice: called with a one-line notice if the context is cropped (see
            `stream_tokens`; default a ContextCropWarning), or if max_new_tokens cuts a
            constrained text short (default a CutConstraintWarning).
        on_token: called with each new token id as it comes (num_beams == 1), e.g. to count
            a reply's tokens per second.
        speculative: draft and verify (speculative.py): a decoder-only model, num_beams 1.
        step_fn: replaces `decode_step` (`compiled_step.compile_decode_step`), num_beams 1.

    Returns:
        the generated text, special tokens left out.
    """
    ids, source, source_mask = text_prompt(model, tokenizer, prompt)
    eos = None if config.ignore_eos else tokenizer.token_id("<eos>")
    config = replace(config, stop_tokens=(() if eos is None else (eos,)) + config.stop_tokens)
    if max_new_tokens is not None:
        config = replace(config, max_new_tokens=max_new_tokens)
    if config.num_beams != 1:
        if speculative is not None:
            raise ValueError("speculative decoding replaces sampling, not beam search")
        if config.sampling != DEFAULT_SAMPLING or on_text is not None or config.constraint:
            raise ValueError(
                f"beam search (num_beams={config.num_beams}) is deterministic and returns "
                "its best hypothesis at the end: no sampling settings, no streaming, no "
                "constraint"
            )
        best = beam_search(model, [ids], config, source=source, source_mask=source_mask)
        tokens = best[0][0].tokens
        shortest_with_stop(tokens, config.stop_strings, tokenizer.decode)
        return tokenizer.decode(tokens)
    text, stops = IncrementalDecoder(tokenizer.decode), StopStrings(config.stop_strings)

    def show(piece: str) -> None:
        if piece and on_text is not None:
            on_text(piece)

    stream = token_stream(
        model,
        [ids],
        config,
        speculative,
        source=source,
        source_mask=source_mask,
        on_notice=on_notice,
        tokenizer=tokenizer,
        **({} if step_fn is None else {"step_fn": step_fn}),
    )
    tokens = []
    for token in stream:
        tokens.append(int(token[0]))
        if on_token is not None:
            on_token(tokens[-1])
        show(text.push(tokens[-1]))
        if tokens[-1] in config.stop_tokens or stops.find(text.text) is not None:
            break
    show(text.flush())  # whatever an unfinished character held back
    cut = len(tokens) == config.max_new_tokens and tokens[-1] not in config.stop_tokens
    if config.constraint is not None and cut and not accepts(config.constraint, tokenizer, tokens):
        message = (
            f"max_new_tokens={config.max_new_tokens} ended the text before the "
            f"{config.constraint.kind} constraint was complete: it is not a whole match; "
            "raise max_new_tokens"
        )
        _Notice(message, on_notice, CutConstraintWarning).give()
    return text.text


def text_prompt(model: nn.Module, tokenizer, prompt: str) -> tuple[list[int], Tensor, Tensor]:
    """(decoder prompt ids, source, source_mask) of a text prompt: a decoder-only model's
    prompt is its text's ids (source None); an encoder-decoder's source is the text + <eos>
    (B=1, M) and its decoder starts from <bos>."""
    ids = tokenizer.encode(prompt)
    if not hasattr(model, "encode"):
        return ids, None, None
    eos, bos = tokenizer.token_id("<eos>"), tokenizer.token_id("<bos>")
    if eos is None or bos is None:
        raise ValueError("an encoder-decoder model needs <bos> and <eos> in the tokenizer")
    device = decoder_of(model).head.weight.device
    source = torch.tensor([ids + [eos]], device=device)  # (1, M)
    return [bos], source, torch.ones_like(source, dtype=torch.bool)
