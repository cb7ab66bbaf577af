"""Characters a tokenizer never saw are replaced visibly (U+FFFD), and bad tokenizer files are
one clear error naming the file."""

import pytest

from attnlab.tokenizer import UNKNOWN_CHAR, Tokenizer, train_bpe_tokenizer, train_char_tokenizer


def test_unseen_characters_decode_as_the_replacement_character_not_as_nothing():
    tok = train_char_tokenizer(["abc"])
    ids = tok.encode("abxc")  # "x" was never seen
    assert ids[2] == tok.token_id("<unk>")
    assert tok.decode(ids) == "ab\ufffdc" == "ab" + UNKNOWN_CHAR + "c"
    assert tok.decode(tok.encode("xx")) == "\ufffd\ufffd"  # every one counted, even at the ends


def test_other_special_tokens_are_still_skipped_and_kept_on_request():
    tok = train_char_tokenizer(["abc"])
    bos, eos, unk = (tok.token_id(t) for t in ("<bos>", "<eos>", "<unk>"))
    ids = [bos, *tok.encode("a"), unk, *tok.encode("b"), eos]
    assert tok.decode(ids) == "a\ufffdb"
    assert tok.decode(ids, skip_special=False) == "<bos>a<unk>b<eos>"


def test_byte_level_bpe_has_no_unknown_characters():
    tok = train_bpe_tokenizer(["hello world " * 20], vocab_size=300)
    text = "naïve 日本 🤖"  # never in the training text: spelled in bytes, not <unk>
    assert tok.token_id("<unk>") not in tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("content", ["", "{not json", '{"model": {"type": "nothing"}}'])
def test_a_corrupt_tokenizer_json_is_a_value_error_naming_the_file(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path} is not a readable tokenizer\.json"):
        Tokenizer.from_file(path)
