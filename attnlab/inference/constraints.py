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
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

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
