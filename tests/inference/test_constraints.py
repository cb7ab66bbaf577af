"""Constrained decoding (inference/constraints.py) with an untrained tiny model and a byte-level
BPE tokenizer: over many seeds, every output parses and validates against its JSON schema
(`jsonschema`, the reference validator), fully matches its regex (Python's `re`), or is one of
its choices; bad schemas and regexes are one-line ValueErrors."""

import json
import random
import re
from dataclasses import replace

import pytest
import torch

from attnlab.inference.config import GenerationConfig
from attnlab.inference.constraints import Constraint, Matcher, vocabulary
from attnlab.inference.generate import generate, generate_text
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import llama_tiny
from attnlab.tokenizer import CHAT_TOKENS, train_bpe_tokenizer

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

TEXT = "the cat sat on the mat. the dog ate the bone. hello world, hello cat. " * 8
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}( [a-z]{1,8})?"
CHOICES = ("the cat", "the dog", 'a "quoted" one', "hello")
SEEDS = 40


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer([TEXT], 320, CHAT_TOKENS)
    model = build_model(replace(llama_tiny(), vocab_size=tokenizer.vocab_size)).eval()
    return model, tokenizer


def outputs(lm, constraint, seeds=SEEDS, max_new_tokens=60, **sampling):
    """The texts of `seeds` sampled rows (one batch), each ended by <eos>."""
    model, tok = lm
    eos = tok.token_id("<eos>")
    config = GenerationConfig(
        max_new_tokens,
        SamplingConfig(temperature=sampling.pop("temperature", 1.5), **sampling),
        stop_tokens=(eos,),
        seed=0,
        constraint=constraint,
    )
    rows = generate(model, [tok.encode("the cat")] * seeds, config, tokenizer=tok)
    assert all(row[-1] == eos for row in rows), "every row ends on <eos> within max_new_tokens"
    return [tok.decode(row) for row in rows]


@pytest.mark.slow
def test_json_schema_outputs_validate(lm):
    texts = outputs(lm, Constraint.json_schema(SCHEMA))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > SEEDS // 2  # the rows really sample


@pytest.mark.slow
def test_regex_outputs_fully_match(lm):
    for text in outputs(lm, Constraint.regex(REGEX), top_k=20):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.slow
def test_choice_outputs_are_choices(lm):
    texts = outputs(lm, Constraint.choice(CHOICES))
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1


@pytest.mark.slow
def test_greedy_and_generate_text(lm):
    model, tok = lm
    config = GenerationConfig(40, SamplingConfig(temperature=0), constraint=Constraint.regex(REGEX))
    text = generate_text(model, tok, "the dog", config)
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    "make, culprit",
    [
        (lambda: Constraint.regex("(cat"), "invalid regex"),
        (lambda: Constraint.json_schema('{"type": '), "invalid json_schema"),
        (lambda: Constraint.json_schema({"type": "nonsense"}), "invalid json_schema"),
        (lambda: Constraint.choice([]), "choices"),
    ],
)
def test_bad_constraints_are_one_line_errors(make, culprit):
    with pytest.raises(ValueError, match=culprit) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_regex_mask_is_the_reference_partial_match(lm):
    """At every step of a sampled walk, the mask holds exactly the tokens whose bytes keep the
    text a prefix of a full match (the `regex` module's partial matching), and <eos> only
    where the text is a full match. (Tokens of no bytes are never allowed: they would not move
    the text.)"""
    regex = pytest.importorskip("regex")
    model, tok = lm
    eos = tok.token_id("<eos>")
    matcher = Matcher(Constraint.regex(REGEX), tok, [eos], tok.vocab_size)
    lt, specials = vocabulary(tok), set(tok.backend.get_added_tokens_decoder())
    rng, text = random.Random(0), ""
    for _ in range(12):
        mask = matcher.mask()
        expected = [
            i not in specials
            and lt.decode_bytes([i]) != b""
            and regex.fullmatch(REGEX, text + lt.decode_bytes([i]).decode("latin-1"), partial=True)
            is not None
            for i in range(tok.vocab_size)
        ]
        expected[eos] = re.fullmatch(REGEX, text) is not None
        assert mask.tolist() == expected, text
        token = rng.choice(mask.nonzero().flatten().tolist())
        if token == eos:
            break
        matcher.advance(token)
        text += lt.decode_bytes([token]).decode("latin-1")


def test_speculative_decoding_takes_no_constraint():
    from attnlab.inference.generate import token_stream
    from attnlab.inference.speculative import NgramDrafter, Speculative

    config = GenerationConfig(4, stop_tokens=(0,), constraint=Constraint.regex("a+"))
    with pytest.raises(ValueError, match="speculative decoding takes no constraint"):
        token_stream(None, [[1]], config, Speculative(NgramDrafter()))
