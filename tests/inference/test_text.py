"""inference/text.py: the incremental decoder's text is, at every step, the full decoding of the
tokens so far (less a trailing incomplete character), checked against the `tokenizers` library's
own decode of all the ids at once; stop strings are found across token boundaries at the same
place as a search of the whole text; and `generate_text` streams through both.

The tokenizer is byte-level BPE trained on text with 2-, 3- and 4-byte UTF-8 characters, so
random ids split characters across tokens, and put bytes in orders that are not UTF-8 at all.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate, generate_text
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.text import REPLACEMENT, IncrementalDecoder, StopStrings
from attnlab.tokenizer import train_bpe_tokenizer

TEXT = "héllo wörld, ünïcode ☃ and 日本語 text 🙂 emoji "
TOKENIZER = train_bpe_tokenizer([TEXT * 4], 300)
IDS = st.lists(st.integers(7, TOKENIZER.vocab_size - 1), min_size=1, max_size=40)


def full(ids: list[int]) -> str:
    return TOKENIZER.backend.decode(ids)  # the `tokenizers` library, all the ids at once


def test_the_fixture_splits_characters_across_tokens():
    pieces = [TOKENIZER.decode([i]) for i in TOKENIZER.encode(TEXT)]
    assert any(REPLACEMENT in p for p in pieces)  # some token holds part of a character


@settings(max_examples=300, deadline=None)
@given(ids=IDS)
def test_incremental_text_is_the_full_decoding_at_every_step(ids):
    decoder, pieces = IncrementalDecoder(TOKENIZER.decode), []
    for n, i in enumerate(ids, 1):
        pieces.append(decoder.push(i))
        whole = full(ids[:n])
        assert whole.startswith(decoder.text)
        if not whole.endswith(REPLACEMENT):  # nothing incomplete at the end: all of it is out
            assert decoder.text == whole
    pieces.append(decoder.flush())
    assert decoder.text == "".join(pieces) == full(ids)


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from(sorted(set(TEXT))), min_size=1, max_size=30))
def test_encoded_text_streams_back_in_whole_characters(text):
    decoder = IncrementalDecoder(TOKENIZER.decode)
    pieces = [decoder.push(i) for i in TOKENIZER.encode(text)]
    assert all(REPLACEMENT not in p for p in pieces)  # a split character waits for its end
    assert "".join(pieces) == text and decoder.flush() == ""


def byte_token(b: int) -> int:
    """The id of the single-byte token for byte `b` (GPT-2's byte -> printable char table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char = (
        chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))
    )
    return TOKENIZER.backend.token_to_id(char)


def test_a_four_byte_character_in_four_tokens_comes_out_once_complete():
    ids = [byte_token(ord("a")), *map(byte_token, "🙂".encode()), byte_token(ord("b"))]
    assert full(ids) == "a🙂b"  # the table is right: the library decodes them to the text
    decoder = IncrementalDecoder(TOKENIZER.decode)
    assert [decoder.push(i) for i in ids] == ["a", "", "", "", "🙂", "b"]


@settings(max_examples=300, deadline=None)
@given(
    ids=IDS,
    stops=st.lists(st.text("lo wéö,☃日 ", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_are_found_where_a_search_of_the_whole_text_finds_them(ids, stops):
    decoder, finder, found = IncrementalDecoder(TOKENIZER.decode), StopStrings(stops), None
    for i in ids:
        decoder.push(i)
        found = finder.find(decoder.text)
        if found is not None:
            break
    if found is None:
        decoder.flush()
        found = finder.find(decoder.text)
    hits = [j for j in (decoder.text.find(s) for s in stops) if j >= 0]
    assert found == (min(hits) if hits else None)


def test_a_stop_string_split_over_three_pushes():
    finder, text = StopStrings(["end."]), ""
    for piece in ["we are at the e", "n", "d. more"]:
        text += piece
        at = finder.find(text)
    assert at == text.index("end.")
    assert StopStrings([]).find("anything") is None


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc en", ["end."], 2), ("abc end", ["end.", "d"], 3), ("abc", ["xyz"], 0), ("a", [], 0)],
)
def test_held_is_the_longest_end_that_begins_a_stop_string(text, stops, held):
    assert StopStrings(stops).held(text) == held


# --- generate and generate_text over byte-level BPE ---------------------------------------------
class Scripted(torch.nn.Module):
    """Forces `script`, one token per call (as test_generate's ScriptedLM)."""

    def __init__(self, script: list[int], vocab_size: int):
        super().__init__()
        from attnlab.components.positions.base import NoPosition

        self.head = torch.nn.Linear(1, vocab_size, bias=False)
        self.embed = torch.nn.Embedding(vocab_size, 1)
        self.blocks = torch.nn.ModuleList()
        self.positions = NoPosition()
        self.script, self.calls = script, 0

    def forward(self, ids, attention_mask=None, **_):
        B, T = ids.shape
        logits = torch.full((B, T, self.head.out_features), -50.0)
        logits[:, :, self.script[min(self.calls, len(self.script) - 1)]] = 50.0
        self.calls += 1
        return logits


GREEDY = GenerationConfig(40, SamplingConfig(temperature=0.0))


def test_generate_text_streams_whole_characters_that_add_up_to_the_text():
    answer = "日本語 ☃ ünïcode 🙂"
    model = Scripted(TOKENIZER.encode(answer), TOKENIZER.vocab_size)
    pieces: list[str] = []
    config = GenerationConfig(len(TOKENIZER.encode(answer)), GREEDY.sampling)
    text = generate_text(model, TOKENIZER, "x", config, on_text=pieces.append)
    assert text == "".join(pieces) == answer
    assert all(REPLACEMENT not in p for p in pieces)


def test_generate_text_ends_after_a_stop_string_across_multi_byte_tokens():
    answer = "héllo wörld, ünïcode ☃ and more"
    model = Scripted(TOKENIZER.encode(answer), TOKENIZER.vocab_size)
    config = GenerationConfig(40, GREEDY.sampling, stop_strings=("ünïcode ☃",))
    text = generate_text(model, TOKENIZER, "x", config)
    assert text.startswith("héllo wörld, ünïcode ☃") and "more" not in text
    n_tokens = model.calls  # one call per generated token: it stopped at the completing one
    assert n_tokens < len(TOKENIZER.encode(answer))


def test_generate_cuts_each_row_after_its_stop_string():
    answer = TOKENIZER.encode("wörld, ünïcode and text")
    model = Scripted(answer, TOKENIZER.vocab_size)
    config = GenerationConfig(30, GREEDY.sampling, stop_strings=("ünï",))
    row = generate(model, [[7]], config, decode=TOKENIZER.decode)[0]
    assert "ünï" in TOKENIZER.decode(row) and "ünï" not in TOKENIZER.decode(row[:-1])
    assert row == answer[: len(row)]


def test_generate_text_decodes_a_bounded_number_of_ids_per_token():
    """Linear, not quadratic: each token decodes a window of a few ids, not the whole text."""

    class Counting:
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return self.tok.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    answer = TOKENIZER.encode("héllo wörld " * 20)
    tok = Counting(TOKENIZER)
    config = GenerationConfig(len(answer), GREEDY.sampling, stop_strings=("zzz",))
    text = generate_text(Scripted(answer, TOKENIZER.vocab_size), tok, "x", config)
    assert text == TOKENIZER.decode(answer)
    assert tok.decoded <= 8 * len(answer)  # re-decoding everything would be ~len(answer)**2 / 2


def test_generate_text_max_new_tokens_is_shorthand_for_the_configs():
    answer = TOKENIZER.encode("héllo wörld, ünïcode")
    model = Scripted(answer, TOKENIZER.vocab_size)
    text = generate_text(model, TOKENIZER, "x", GREEDY, max_new_tokens=3)
    assert text == TOKENIZER.decode(answer[:3]) and model.calls == 3
