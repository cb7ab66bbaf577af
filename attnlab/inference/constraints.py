"""Constrained decoding: the output must be JSON of a schema, match a regular expression, or be
one of a list of choices, enforced token by token with a mask applied before sampling.

A constraint is compiled to a grammar over bytes, and at each step the grammar's parser tells
which tokens of the vocabulary may come next: those whose bytes keep the text a prefix of some
string the grammar accepts (Willard & Louf 2023, "Efficient Guided Generation for LLMs";
Microsoft's llguidance, which does this with a derivative-based lexer and an Earley parser and
computes the mask over the token trie in tens of microseconds). Tokens outside the mask get
-inf, like the banned stop tokens before min_new_tokens (sampling.py), so every sampler
setting still applies to the tokens left. The row's stop tokens (EOS, the chat template's end
of turn) are allowed only where the text so far is a whole accepted string, and are the only
tokens allowed once the grammar can take nothing more.

    Constraint (what: schema / regex / choices) ─grammar─> llguidance LLMatcher per row
        ─mask()─> (V,) allowed ─> sample ─> token ─advance(token)─> next mask

The library is llguidance (docs/generation.md, "Constrained decoding", says why and what it
costs per token).

A constraint that cannot be finished within max_new_tokens is refused before generating
(`check_room`), on a sound lower bound of the tokens any accepted text needs: for choices the
exact fewest (`fewest_pieces`); else its fewest bytes (`Constraint.min_bytes`) over the most
bytes one token of the vocabulary writes, rounded up. That bound lets through a schema whose
text the vocabulary's longest tokens could nearly fill (SmolLM2 has an 80-byte token of '#',
which may stand in a JSON string); a reply cut at max_new_tokens before the grammar is complete
is said to be so (`generate_text`'s notice; the server's finish_reason "length", as OpenAI's).
"""

import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

try:
    from re import _parser as regex_parser  # Python's own regex parser (3.11+)
except ImportError:  # Python 3.10 names it sre_parse
    import sre_parse as regex_parser

KINDS = ("json_schema", "json_object", "regex", "choice")
# Compact JSON (no free whitespace between tokens): a model, small or untrained, otherwise may
# write whitespace forever where the grammar allows it.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What a generated text must be. kind: one of KINDS; value: the schema as JSON text
    (json_schema), the regular expression (regex), the choices (choice, a tuple of strings),
    or "" (json_object: any JSON object). Build with the class methods."""

    kind: str
    value: str | tuple[str, ...] = ""

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "Constraint":
        return cls("choice", tuple(choices))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "choice" and not (
            self.value and all(isinstance(c, str) and c for c in self.value)
        ):
            raise ValueError(
                f"choices must be a non-empty list of non-empty strings, got {self.value!r}"
            )
        grammar(self)  # compile once here, so a bad schema or regex fails when it is given

    def min_bytes(self) -> int:
        """A lower bound on the UTF-8 bytes of any text the constraint accepts (0 where it
        knows nothing: still a bound)."""
        if self.kind == "choice":
            return min(len(c.encode()) for c in self.value)
        if self.kind == "regex":
            return regex_min_chars(self.value)  # each character is at least one byte
        if self.kind == "json_object":
            return 2  # {}
        return json_min_bytes(json.loads(self.value))


@lru_cache(maxsize=256)
def grammar(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; a one-line ValueError if it does not compile."""
    LLMatcher = library().LLMatcher
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "json_schema":
            text = LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = LLMatcher.grammar_from_regex(value)
        else:  # a Lark grammar of literal alternatives (JSON string syntax escapes them)
            text = LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, value)))
    except ValueError as err:
        raise ValueError(f"invalid {kind}: {one_line(str(err))}") from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise ValueError(f"invalid {kind}: {one_line(messages[0])}")
    return text


# --- the fewest tokens a constraint needs -----------------------------------------------------
def min_tokens(constraint: Constraint, tokenizer) -> int:
    """A lower bound on the tokens of any text `constraint` accepts, written with `tokenizer`:
    for choices the exact fewest (each choice split into the vocabulary's tokens in as few
    pieces as it can be), else the fewest bytes over the longest token's bytes, rounded up."""
    if constraint.kind == "choice":
        return min(fewest_pieces(c.encode(), tokenizer) for c in constraint.value)
    return math.ceil(constraint.min_bytes() / longest_token(tokenizer))


def fewest_pieces(text: bytes, tokenizer) -> int:
    """The fewest tokens whose bytes, joined, are `text`: fewest[i] for text[:i], each from the
    best fewest[j] + 1 with text[j:i] one token (dynamic programming over the end points)."""
    pieces, longest = token_bytes(tokenizer), longest_token(tokenizer)
    fewest = [0] + [math.inf] * len(text)
    for i in range(1, len(text) + 1):
        for j in range(max(0, i - longest), i):
            if fewest[j] + 1 < fewest[i] and text[j:i] in pieces:
                fewest[i] = fewest[j] + 1
    return fewest[-1]  # finite: every byte is a token of a byte-level vocabulary (else inf)


def accepts(constraint: Constraint, tokenizer, tokens: Sequence[int]) -> bool:
    """Whether the text of `tokens` is a whole string the constraint accepts."""
    matcher = library().LLMatcher(vocabulary(tokenizer), grammar(constraint), log_level=0)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def check_room(constraint: Constraint, tokenizer, max_tokens: int, name: str) -> None:
    """A one-line ValueError when no text the constraint accepts fits in `max_tokens` tokens
    (`name`: the setting the caller calls it, e.g. max_new_tokens)."""
    need = min_tokens(constraint, tokenizer)
    if max_tokens >= need:
        return
    if constraint.kind == "choice":
        why = f"its shortest choice in this vocabulary's tokens is {need} tokens"
    else:
        why = (
            f"any text it accepts has at least {constraint.min_bytes()} bytes and this "
            f"vocabulary's longest token is {longest_token(tokenizer)} bytes, so it needs at "
            f"least {need} tokens"
        )
    raise ValueError(
        f"the {constraint.kind} constraint cannot be finished within {name}={max_tokens}: "
        f"{why}: raise {name} or relax the constraint"
    )


@lru_cache(maxsize=8)
def token_bytes(tokenizer) -> frozenset[bytes]:
    """The bytes each token of the vocabulary writes. Special tokens are left out: no
    constraint's text holds them. Cached per tokenizer object."""
    vocab = vocabulary(tokenizer)
    texts = [vocab.decode_bytes([i]) for i in range(vocab.vocab_size)]
    return frozenset(
        b
        for i, b in enumerate(texts)
        if b and not (vocab.is_special_token(i) or b.startswith(b"\xff"))  # 0xFF: _TokenTexts'
    )


def longest_token(tokenizer) -> int:
    """The most bytes one token of the vocabulary writes (at least 1)."""
    return max(map(len, token_bytes(tokenizer)), default=1)


def regex_min_chars(pattern: str) -> int:
    """The fewest characters a full match of `pattern` has, as Python's own parser counts it
    (`getwidth`); 0 for a pattern Python reads otherwise than llguidance (Rust's syntax): one
    it cannot parse, or one it warns about (a nested set such as [[:alpha:]], or &&, whose
    meaning differs)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            return regex_parser.parse(pattern).getwidth()[0]
    except (re.error, FutureWarning, RecursionError, OverflowError):
        return 0


TYPE_BYTES = {"boolean": 4, "null": 4, "number": 1, "integer": 1}  # true, null, a digit


def json_min_bytes(schema, root=None, refs: tuple[str, ...] = ()) -> int:
    """A lower bound on the bytes of compact JSON (as JSON_OPTIONS writes it: {"a":1}) valid
    for `schema`. Read: type (a list: the least of its types), a string's minLength, an
    array's minItems (items, prefixItems), an object's required properties, const, enum,
    anyOf / oneOf (the least), allOf (the most), and $ref inside the schema (a cycle counts 0);
    every other keyword only makes texts longer, so leaving it out keeps the bound.
    `root`: the whole schema, for $ref; `refs`: the $refs being followed."""
    if schema is True:
        return 1  # any JSON value: a digit at least
    if not isinstance(schema, dict):
        return 0  # false accepts nothing; anything unread counts 0
    root = schema if root is None else root
    bounds = [type_min_bytes(schema, root, refs)]  # every keyword holds: the most of them
    if "const" in schema:
        bounds.append(value_min_bytes(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        bounds.append(min(map(value_min_bytes, schema["enum"])))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            bounds.append(min(json_min_bytes(s, root, refs) for s in schema[key]))
    if isinstance(schema.get("allOf"), list):
        bounds += [json_min_bytes(s, root, refs) for s in schema["allOf"]]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in refs:
        bounds.append(json_min_bytes(resolved(root, ref), root, (*refs, ref)))
    return max(bounds)


def type_min_bytes(schema: dict, root, refs: tuple[str, ...]) -> int:
    """The bound `type` alone gives (1 without one: any JSON value)."""
    types = schema.get("type")
    if types is None:
        return 1
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types:
        return 0
    bounds = []
    for kind in types:
        if kind == "string":
            bounds.append(2 + whole(schema.get("minLength")))  # each character: >= 1 byte
        elif kind == "array":
            n, first = whole(schema.get("minItems")), schema.get("prefixItems") or []
            first = first if isinstance(first, list) else []
            items = [first[i] if i < len(first) else schema.get("items", True) for i in range(n)]
            bounds.append(2 + sum(json_min_bytes(s, root, refs) for s in items) + max(n - 1, 0))
        elif kind == "object":
            names = schema.get("required") or []
            names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            fields = sum(
                value_min_bytes(n) + 1 + json_min_bytes(properties.get(n, True), root, refs)
                for n in set(names)
            )
            bounds.append(2 + fields + max(len(set(names)) - 1, 0))  # {"a":1,"b":2}
        else:
            bounds.append(TYPE_BYTES.get(kind, 0))
    return min(bounds)


def value_min_bytes(value) -> int:
    """The fewest bytes of a JSON value written compactly: a string as json.dumps writes it
    (raw UTF-8, the shortest escapes), a number 1 (1.0 may be written 1, 100 as 1e2)."""
    if isinstance(value, bool):
        return 4 if value else 5
    if value is None:
        return 4
    if isinstance(value, (int, float)):
        return 1
    if isinstance(value, str):
        return len(json.dumps(value, ensure_ascii=False).encode())
    if isinstance(value, list):
        return 2 + sum(map(value_min_bytes, value)) + max(len(value) - 1, 0)
    if isinstance(value, dict):
        fields = sum(value_min_bytes(k) + 1 + value_min_bytes(v) for k, v in value.items())
        return 2 + fields + max(len(value) - 1, 0)
    return 0


def resolved(root, ref: str):
    """The part of the schema a local $ref ("#", "#/$defs/a") points to; None for another."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def whole(value) -> int:
    """A count keyword (minLength, minItems) as a non-negative int; 0 when malformed."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def library():
    """The llguidance module, or a one-line error saying how to install it."""
    try:
        import llguidance
    except ModuleNotFoundError:
        raise ValueError(
            "constrained decoding needs llguidance: pip install 'attnlab[constrain]'"
        ) from None
    return llguidance


def one_line(message: str) -> str:
    """An error message of the library, on one line."""
    return " ".join(message.split())


@lru_cache(maxsize=8)
def vocabulary(tokenizer):
    """llguidance's view of an attnlab Tokenizer: the bytes of each id. Cached per tokenizer
    object (building it walks the vocabulary).

    The library reads a byte-level BPE's tokenizer JSON itself (its tokens spell bytes in
    GPT-2's byte -> unicode alphabet); other tokenizers it cannot read (attnlab's character
    tokenizer) are given as each id's decoded text."""
    llg = library()
    eos = tokenizer.token_id("<eos>")
    eos = 0 if eos is None else eos
    try:
        return llg.LLTokenizer(tokenizer.backend.to_str(), eos_token=eos)
    except ValueError:
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTexts(tokenizer, eos)), eos_token=eos)


class _TokenTexts:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each id's bytes (special tokens
    as 0xFF + name, the library's mark for tokens no text contains), and an encoder."""

    def __init__(self, tokenizer, eos: int):
        added = tokenizer.backend.get_added_tokens_decoder()
        self.special_token_ids = sorted(i for i, t in added.items() if t.special)
        self.tokens = [
            b"\xff" + added[i].content.encode()
            if i in added and added[i].special
            else tokenizer.backend.decode([i], skip_special_tokens=False).encode()
            for i in range(tokenizer.vocab_size)
        ]
        self.eos_token_id, self.bos_token_id = eos, tokenizer.token_id("<bos>")
        self.encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self.encode(text.decode(errors="replace") if isinstance(text, bytes) else text)


class Matcher:
    """One row's constraint while it generates: `mask()` the tokens allowed next, `advance` by
    the token chosen.

    Args:
        constraint: what the row's text must be.
        tokenizer: attnlab Tokenizer of the model.
        stop_tokens: the ids that end the row (at least one: the constraint ends there).
        vocab_size: V of the model's logits (>= the tokenizer's; the rest are never allowed).
    """

    def __init__(
        self, constraint: Constraint, tokenizer, stop_tokens: Sequence[int], vocab_size: int
    ):
        if not stop_tokens:
            raise ValueError("a constraint needs a stop token (e.g. <eos>) to end the text on")
        self.vocab = vocabulary(tokenizer)
        self.matcher = library().LLMatcher(self.vocab, grammar(constraint), log_level=0)
        self.stops = sorted(set(stop_tokens))
        self.V = vocab_size
        self.finished = False

    def mask(self) -> Tensor:
        """(V,) bool: the tokens that keep the text inside the constraint (stop tokens where
        the text is complete)."""
        allowed = torch.zeros(self.V, dtype=torch.bool)
        if self.finished:
            allowed[self.stops] = True  # the row is over: it repeats its stop token
            return allowed
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        n = min(len(bias), self.V)
        allowed[:n] = bias[:n] > 0
        allowed[self.vocab.eos_token] = False  # the row's own stop tokens stand for EOS
        allowed[self.stops] = self.matcher.is_accepting()
        if not allowed.any():
            raise ValueError(
                "no token of the vocabulary can continue the constraint here: this tokenizer "
                "cannot write what it asks for"
            )
        return allowed

    def advance(self, token: int) -> None:
        """Take the chosen token (which `mask` allowed)."""
        if self.finished:
            return
        if token in self.stops:
            self.finished = True
        elif not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the constraint: {self.matcher.get_error()}")


def banned_by(matchers: Sequence[Matcher | None], device) -> Tensor | None:
    """(B, V) bool, True where row b's constraint forbids a token (rows without one: none);
    None when no row has a constraint."""
    if all(m is None for m in matchers):
        return None
    V = next(m for m in matchers if m is not None).V
    rows = [torch.zeros(V, dtype=torch.bool) if m is None else ~m.mask() for m in matchers]
    return torch.stack(rows).to(device)
