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
SEEDS = 100  # the issue's acceptance: 100 seeds, each a row of one batch


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


# --- the fewest tokens a constraint needs -------------------------------------------------------
def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


ITEM = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
# (schema, a shortest valid instance written by hand, whether the bound is exact for it)
SCHEMAS = [
    (SCHEMA, {"name": "", "age": 0, "pet": "cat", "ok": True}, True),
    ({"type": "string", "minLength": 5}, "aaaaa", True),
    ({"type": "array", "items": ITEM, "minItems": 3}, [{"id": 0}] * 3, True),
    ({"type": "array", "prefixItems": [{"const": "ab"}], "minItems": 2}, ["ab", 0], True),
    ({"type": ["null", "boolean", "string"]}, "", True),
    ({"enum": ["long one", 7, None]}, 7, True),
    ({"anyOf": [{"type": "boolean"}, {"type": "string", "minLength": 1}]}, "a", True),
    ({"allOf": [{"type": "string"}, {"type": "string", "minLength": 3}]}, "aaa", True),
    (
        {
            "$defs": {"pet": {"enum": ["dog", "cat"]}},
            "type": "object",
            "properties": {"p": {"$ref": "#/$defs/pet"}, "q": {"type": "number"}},
            "required": ["p"],
        },
        {"p": "dog"},
        True,
    ),
    (  # a list of any length: the $ref cycle counts 0 where it repeats
        {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
            },
            "required": ["v", "next"],
        },
        {"v": 0, "next": None},
        True,
    ),
    ({"type": "object", "properties": {"ü": {"const": "é"}}, "required": ["ü"]}, {"ü": "é"}, True),
    ({"type": "integer", "minimum": 1000}, 1000, False),  # the bound: a digit
    ({"type": "string", "pattern": "^[a-z]{4}$"}, "abcd", False),  # pattern: not read
]


def accepts(constraint: Constraint, tok, text: str) -> bool:
    """Whether llguidance's matcher, fed `text`'s tokens, ends on a complete text."""
    matcher = Matcher(constraint, tok, [tok.token_id("<eos>")], tok.vocab_size)
    return all(matcher.matcher.consume_token(t) for t in tok.encode(text)) and (
        matcher.matcher.is_accepting()
    )


@pytest.mark.parametrize("schema, shortest, exact", SCHEMAS)
def test_json_min_bytes_is_a_lower_bound(lm, schema, shortest, exact):
    """The instance is valid (jsonschema) and accepted by the constraint (llguidance), so no
    bound may pass its compact length; where the bound reads every keyword, it is that."""
    _, tok = lm
    jsonschema.validate(shortest, schema)
    constraint = Constraint.json_schema(schema)
    text = compact(shortest)
    assert accepts(constraint, tok, text)
    bound = constraint.min_bytes()
    assert bound == len(text.encode()) if exact else 0 < bound < len(text.encode())


def test_json_object_and_choices_bounds():
    assert Constraint.json_object().min_bytes() == len("{}")
    assert Constraint.choice(["hello", "né", "a long choice"]).min_bytes() == len("né".encode())


@pytest.mark.parametrize(
    "pattern, alphabet",
    [
        (REGEX, "cato-01 "),
        (r"(ab|c)+d?", "abcd"),
        (r"a{3,}|b{2}c", "abc"),
        (r"(x|yy)(x|yy)z*", "xyz"),
        (r"[0-9]{2}-?[0-9]", "0-"),
    ],
)
def test_regex_min_chars_is_the_shortest_full_match(pattern, alphabet):
    """Brute force: the shortest string over `alphabet` that fully matches (Python's re)."""
    import itertools

    shortest = next(
        n
        for n in range(12)
        if any(re.fullmatch(pattern, "".join(s)) for s in itertools.product(alphabet, repeat=n))
    )
    assert Constraint.regex(pattern).min_bytes() == shortest


@pytest.mark.parametrize("pattern", [r"[[:alpha:]]{3}", r"[a-z&&[^aeiou]]x", r"\p{L}{4}"])
def test_regexes_python_reads_otherwise_count_zero(pattern):
    assert Constraint.regex(pattern).min_bytes() == 0


def test_min_tokens_divides_by_the_longest_token(lm):
    from attnlab.inference.constraints import longest_token, min_tokens

    _, tok = lm
    special = set(tok.backend.get_added_tokens_decoder())
    longest = max(len(tok.decode([i]).encode()) for i in range(tok.vocab_size) if i not in special)
    assert longest_token(tok) == longest > 1
    constraint = Constraint.regex(f"a{{{3 * longest + 1}}}")
    assert min_tokens(constraint, tok) == 4


def test_generate_refuses_a_constraint_it_cannot_finish(lm):
    model, tok = lm
    config = GenerationConfig(
        16, constraint=Constraint.json_schema({"type": "string", "minLength": 2000})
    )
    with pytest.raises(ValueError, match="cannot be finished within max_new_tokens=16") as err:
        generate(model, [tok.encode("the cat")], config, tokenizer=tok)
    assert "\n" not in str(err.value) and "2002 bytes" in str(err.value)
    assert "raise max_new_tokens or relax the constraint" in str(err.value)


def test_the_choice_bound_is_the_fewest_tokens(lm):
    """Each choice's fewest tokens, found by a breadth-first search over the vocabulary
    (every token whose bytes continue the choice where the text so far ends), is what
    check_room refuses below and takes at; the matcher accepts the tokens the search found.
    "zqzqx" has no merges in this vocabulary: the bytes over the longest token would allow 1."""
    from attnlab.inference.constraints import check_room, min_tokens

    model, tok = lm
    special = set(tok.backend.get_added_tokens_decoder())
    texts = {i: tok.decode([i]).encode() for i in range(tok.vocab_size) if i not in special}

    def fewest(choice: bytes) -> list[int]:
        paths, seen = {0: []}, {0}
        while len(choice) not in paths:
            paths = {
                end: path + [i]
                for start, path in paths.items()
                for i, t in texts.items()
                if t and choice.startswith(t, start) and (end := start + len(t)) not in seen
            }
            seen |= set(paths)
        return paths[len(choice)]

    for choices in (("the cat", "hello world"), ("zqzqx",), CHOICES):
        constraint = Constraint.choice(choices)
        paths = [fewest(c.encode()) for c in choices]
        best = min(paths, key=len)
        assert accepts_tokens(constraint, tok, best)
        assert min_tokens(constraint, tok) == len(best)
        check_room(constraint, tok, len(best), "max_new_tokens")
        with pytest.raises(ValueError, match=f"shortest choice .* is {len(best)} tokens"):
            check_room(constraint, tok, len(best) - 1, "max_new_tokens")
    assert len(fewest(b"zqzqx")) == 5


def accepts_tokens(constraint: Constraint, tok, tokens: list[int]) -> bool:
    matcher = Matcher(constraint, tok, [tok.token_id("<eos>")], tok.vocab_size)
    return all(matcher.matcher.consume_token(t) for t in tokens) and (
        matcher.matcher.is_accepting()
    )


def test_a_text_cut_before_its_constraint_is_complete_says_so(lm):
    """generate_text gives one notice when max_new_tokens ends a constrained text the
    constraint does not accept (jsonschema: not even JSON), and none when it ends complete."""
    from attnlab.inference.generate import CutConstraintWarning

    model, tok = lm
    notices = []
    config = GenerationConfig(
        8, SamplingConfig(temperature=0.0), constraint=Constraint.json_schema(SCHEMA)
    )
    text = generate_text(model, tok, "the cat", config, on_notice=notices.append)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert notices == [
        "max_new_tokens=8 ended the text before the json_schema constraint was complete: it "
        "is not a whole match; raise max_new_tokens"
    ]
    with pytest.warns(CutConstraintWarning, match="max_new_tokens=8 ended the text"):
        generate_text(model, tok, "the cat", config)
    complete = replace(config, max_new_tokens=60)
    jsonschema.validate(
        json.loads(generate_text(model, tok, "the cat", complete, on_notice=notices.append)), SCHEMA
    )
    assert len(notices) == 1
