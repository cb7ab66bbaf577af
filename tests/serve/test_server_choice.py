"""Choice turns token events into text: incremental decoding equals decoding all the tokens at
once, a stop string ends the text before it (even across tokens), and a stream never sends
text that a stop string later claims."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.serve.choice import Choice
from attnlab.serve.types import Request, SamplingParams, TokenEvent
from attnlab.tokenizer import train_bpe_tokenizer

TOKENIZER = train_bpe_tokenizer(["héllo wörld, ünïcode ☃ and 日本語 text " * 4], 300)


def run(tokens: list[int], stop: tuple[str, ...]) -> tuple[Choice, list[str], list[str]]:
    """Feed the tokens one event each (the last one finishing with "length"); return the
    choice, the stream's deltas and the ids it cancelled."""
    cancelled: list[str] = []
    request = Request("r", (1,), SamplingParams(max_tokens=len(tokens), stop=stop))
    choice = Choice(0, request, TOKENIZER, cancelled.append)
    deltas = []
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        done = choice.take(TokenEvent("r", t, -1.0, None, "length" if last else None))
        deltas.append(choice.delta())
        if done:
            break
    return choice, deltas, cancelled


def reference(tokens: list[int], stop: tuple[str, ...]) -> str:
    """What the answer must be: all the tokens decoded, cut before the first stop string."""
    text = TOKENIZER.decode(tokens)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def test_characters_split_over_tokens_come_out_whole():
    tokens = TOKENIZER.encode("☃ 日本語 ünïcode")
    byte_tokens = [t for t in tokens if "\ufffd" in TOKENIZER.decode([t])]
    assert byte_tokens, "the fixture must split some character over tokens"
    choice, deltas, _ = run(tokens, ())
    assert choice.text == "".join(deltas) == "☃ 日本語 ünïcode"
    assert all("\ufffd" not in d for d in deltas)


def test_a_stop_string_across_tokens_cuts_and_cancels():
    tokens = TOKENIZER.encode("héllo wörld, and more text after it")
    choice, deltas, cancelled = run(tokens, ("wörld,",))
    assert choice.text == "".join(deltas) == "héllo "
    assert choice.finish_reason == "stop" and cancelled == ["r"]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(7, 299), min_size=1, max_size=30),
    stop=st.lists(st.text("lo wéö,☃日 ", min_size=1, max_size=3), max_size=3),
)
def test_streamed_text_is_the_whole_text_cut_at_the_stop(tokens, stop):
    choice, deltas, _ = run(tokens, tuple(stop))
    expected = reference(choice.tokens, tuple(stop))
    assert choice.text == "".join(deltas) == expected
    if any(s in TOKENIZER.decode(tokens) for s in stop):
        assert choice.finish_reason == "stop"


def test_events_end_with_the_finishing_one():
    async def main():
        request = Request("r", (1,), SamplingParams(max_tokens=3))
        choice = Choice(0, request, TOKENIZER, lambda rid: None)
        for event in ("a", "b", None):
            t = None if event is None else TOKENIZER.encode(event)[0]
            choice.queue.put_nowait(TokenEvent("r", t, None, None, None if event else "length"))
        return [e.token_id async for e in choice.events()], choice

    seen, choice = asyncio.run(main())
    assert len(seen) == 3 and seen[-1] is None and choice.text == "ab"


def test_merged_shows_each_event_once_even_when_all_have_come():
    """All of a choice's events are in its queue before the stream reads any (a fast engine, a
    slow client): the stream still sees the choice after each event in turn, so it sends the
    finishing chunk once, after the last token (it once saw the finished choice again and
    again, and a forced tool call's stream ended on a second, empty "stop")."""
    from attnlab.serve.app import merged

    async def main():
        choices = []
        for i in range(2):
            request = Request(f"r{i}", (1,), SamplingParams(max_tokens=3))
            c = Choice(i, request, TOKENIZER, lambda rid: None)
            for k, word in enumerate(("a", "b", "c")):
                finish = "length" if k == 2 else None
                c.queue.put_nowait(TokenEvent(c.request.request_id, TOKENIZER.encode(word)[0],
                                              None, None, finish))  # fmt: skip
            choices.append(c)
        return [(c.index, len(c.tokens), c.finish_reason) async for c in merged(choices)]

    seen = asyncio.run(main())
    for i in range(2):
        assert [(n, f) for j, n, f in seen if j == i] == [(1, None), (2, None), (3, "length")]
