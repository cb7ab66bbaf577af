"""Pretrained tokenizer files (GPT-2's byte-level BPE, T5's Unigram, BERT's WordPiece, built
with the `tokenizers` library as the Hub's are) open into attnlab's Tokenizer with the same ids,
decoding and special tokens as transformers' AutoTokenizer on the same files."""

import json

import pytest

from attnlab.tokenizer import UNKNOWN_CHAR, Tokenizer
from tests.hf_tokenizer_files import TEXTS, bert_files, gpt2_files, t5_files

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

BUILDERS = {"gpt2": gpt2_files, "t5": t5_files, "bert": bert_files}
SPECIAL_TEXTS = {  # special and added tokens inside running text
    "gpt2": "Hello<|endoftext|> world <|im_start|>user<tool>x<|im_end|>",
    "t5": "translate English to German: <extra_id_0> house </s> is <extra_id_2>",
    "bert": "[CLS] the house [SEP] is [MASK] wonderful",
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory):
    """(kind, attnlab Tokenizer, transformers tokenizer) on the same files."""
    directory = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    return request.param, Tokenizer.from_pretrained(directory), hf


def test_ids_equal_transformers_with_and_without_specials(pair):
    kind, ours, hf = pair
    for text in [*TEXTS, SPECIAL_TEXTS[kind]]:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode_with_specials(text) == hf(text)["input_ids"], text


def test_decoding_equals_transformers_skipping_specials_or_not(pair):
    """Equal on every text; where the ids hold <unk> (T5's unseen "Q"), attnlab writes each one
    as U+FFFD (its rule: an unknown character is replaced visibly) where transformers drops it."""
    kind, ours, hf = pair
    for text in [*TEXTS, SPECIAL_TEXTS[kind]]:
        ids = hf(text)["input_ids"]
        assert ours.decode(ids, skip_special=False) == hf.decode(ids), text
        if hf.unk_token_id in ids and kind != "gpt2":
            assert ours.decode(ids).count(UNKNOWN_CHAR) == ids.count(hf.unk_token_id)
            without = [i for i in ids if i != hf.unk_token_id]
            assert ours.decode(without) == hf.decode(ids, skip_special_tokens=True), text
        else:
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_special_tokens_and_max_length_are_transformers(pair):
    kind, ours, hf = pair
    for name in ("bos", "eos", "pad", "cls", "sep", "mask"):
        assert ours.token_id(f"<{name}>") == getattr(hf, f"{name}_token_id"), name
    if kind != "gpt2":  # GPT-2's unk is its eos: not an unknown-character marker here
        assert ours.token_id("<unk>") == hf.unk_token_id
    assert ours.model_max_length == hf.model_max_length
    added = {t.content for t in ours.backend.get_added_tokens_decoder().values() if t.special}
    assert added == set(hf.all_special_tokens) | {
        t.content for t in hf.added_tokens_decoder.values() if t.special
    }


def test_gpt2s_eos_decodes_away_not_as_the_unknown_marker(tmp_path):
    """<|endoftext|> is GPT-2's bos, eos and unk: decode skips it, never writes U+FFFD."""
    ours = Tokenizer.from_pretrained(gpt2_files(tmp_path))
    eos = ours.token_id("<eos>")
    assert ours.token_id("<unk>") is None
    assert ours.decode(ours.encode("Hello") + [eos]) == "Hello"


def test_a_special_named_only_in_the_config_is_made_special(tmp_path):
    """tokenizer_config.json names an eos that tokenizer.json holds as a plain vocabulary
    entry: it becomes one special id in text and is skipped on decode, as transformers does."""
    directory = bert_files(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(directory).backend.get_vocab()
    plain = next(t for t in sorted(vocab) if t.isalpha() and len(t) > 2)
    config["eos_token"] = plain
    del config["added_tokens_decoder"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    text = f"the house {plain} is"
    assert ours.token_id("<eos>") == vocab[plain] == hf.eos_token_id
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    ids = hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert plain not in ours.decode(ids)


def test_a_config_that_is_not_json_is_named(tmp_path):
    directory = gpt2_files(tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json' is not a JSON object"):
        Tokenizer.from_pretrained(directory)
