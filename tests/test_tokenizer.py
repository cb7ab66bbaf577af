"""Tokenizers: round trips, and tokenizer.json files that `transformers` reads and writes."""

import pytest

from attnlab.tokenizer import (
    SPECIAL_TOKENS,
    Tokenizer,
    train_bpe_tokenizer,
    train_char_tokenizer,
)

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\tSpeak, speak.\r\n"
    "Ünïcödé: naïve café, Straße, ΑΒΓ αβγ, 日本語のテキスト, emoji 🤖🚀.\n"
    "    indented code(x) -> {'a': [1, 2]}  # trailing spaces   \n"
)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    corpus = [TEXT * 3, "def f(x):\n    return x * 2\n" * 20, "the quick brown fox " * 50]
    return train_bpe_tokenizer(corpus, vocab_size=300)


def test_char_tokenizer_round_trips_and_puts_specials_first():
    tok = train_char_tokenizer([TEXT])
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)  # one id per character
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == len(SPECIAL_TOKENS) + len(set(TEXT))
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    chars = sorted(set(TEXT))  # regular ids follow in sorted character order
    assert tok.encode("".join(chars)) == list(range(len(SPECIAL_TOKENS), tok.vocab_size))


def test_char_tokenizer_maps_unseen_characters_to_unk():
    tok = train_char_tokenizer(["abc"])
    assert tok.encode("abz") == [tok.encode("a")[0], tok.encode("b")[0], tok.token_id("<unk>")]


def test_bpe_round_trips_non_ascii_and_whitespace(bpe):
    assert bpe.vocab_size == 300
    for text in (TEXT, "unseen words: Quixotic ŽŹŻ ∑∫ 🦀\n\n\n", "   ", "\n"):
        assert bpe.decode(bpe.encode(text)) == text
    assert len(bpe.encode("the quick brown fox ")) < len("the quick brown fox ")  # it merged


def test_bpe_needs_room_for_the_byte_alphabet():
    with pytest.raises(ValueError, match="vocab_size >= 263, got 100"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_saved_tokenizer_json_loads_in_transformers(tmp_path, bpe, kind):
    transformers = pytest.importorskip("transformers")
    tok = train_char_tokenizer([TEXT]) if kind == "char" else bpe
    tok.save(tmp_path / "tokenizer.json")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert theirs.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT)
    assert theirs.decode(tok.encode(TEXT)) == TEXT
    assert theirs.convert_tokens_to_ids("<mask>") == tok.token_id("<mask>")
    # ...and our own loader reads it back to the same ids.
    again = Tokenizer.from_file(tmp_path)
    assert again.encode(TEXT) == tok.encode(TEXT) and again.special_ids == tok.special_ids


@pytest.mark.hf
def test_tokenizer_json_written_by_transformers_loads(tmp_path, bpe):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend, pad_token="<pad>", mask_token="<mask>"
    )
    theirs.save_pretrained(tmp_path / "hf")
    loaded = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    assert loaded.encode(TEXT) == bpe.encode(TEXT) == theirs.encode(TEXT, add_special_tokens=False)
    assert loaded.decode(loaded.encode(TEXT)) == TEXT
    assert loaded.token_id("<mask>") == bpe.token_id("<mask>")


def test_missing_tokenizer_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_file(tmp_path)


def test_bpe_with_only_the_users_special_tokens():
    """fixed_specials=False: GPT-2 style, <|endoftext|> the one special (id 0), no fixed seven;
    the default keeps them first (issue 31)."""
    corpus = ["the cat sat on the mat. " * 20, "héllo wörld 🙂 " * 5]
    gpt2 = train_bpe_tokenizer(corpus, 300, ["<|endoftext|>"], fixed_specials=False)
    vocab = gpt2.backend.get_vocab()
    assert vocab["<|endoftext|>"] == 0 and not set(SPECIAL_TOKENS) & set(vocab)
    assert 257 < gpt2.vocab_size <= 300  # 1 special + 256 bytes + merges
    ids = gpt2.encode("the cat<|endoftext|>🙂 new")
    assert 0 in ids and gpt2.decode(ids, skip_special=False) == "the cat<|endoftext|>🙂 new"
    default = train_bpe_tokenizer(corpus, 300, ["<|endoftext|>"])
    assert [default.backend.id_to_token(i) for i in range(8)] == [*SPECIAL_TOKENS, "<|endoftext|>"]
