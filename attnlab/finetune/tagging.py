"""Tagging Python source: the lexical tokens of the standard `tokenize` module as labelled
spans, and BIO tags over characters or over a tokenizer's tokens.

    types     NAME, KEYWORD (a NAME for which keyword.iskeyword holds), STRING, NUMBER,
              COMMENT, OP; everything else (whitespace, newlines, indents) is O
    spans     (start, end, type) character offsets into the text
    tags      B-X on a span's first unit, I-X on the rest, O outside (Ramshaw & Marcus 1995)

`char_tags` writes a text's spans as one tag per character; `token_tags` moves them onto the
tokens of any tokenizer through their character offsets (the first-subword or all-subwords
rule). `spans_from_words` reads word-level BIO tags (a user's CoNLL-style data) as spans, so
both kinds of data meet in one format.
"""

import bisect
import io
import keyword
import re
import tokenize
from typing import Literal

TAG_TYPES = ("NAME", "KEYWORD", "STRING", "NUMBER", "COMMENT", "OP")


def line_starts(source: str) -> list[int]:
    """Offsets where the lines of `source` start, as `tokenize` reads them (a readline that
    ends lines at "\n" only: not at form feeds, which str.splitlines also breaks at), and
    the end of the text last."""
    starts = [0]
    for line in io.StringIO(source).readlines():
        starts.append(starts[-1] + len(line))
    return starts


def tag_spans(source: str) -> list[tuple[int, int, str]]:
    """Character spans (start, end, type) of the lexical tokens of Python `source`, typed by
    the standard `tokenize` module: NAME, KEYWORD (a NAME for which `keyword.iskeyword` holds),
    STRING, NUMBER, COMMENT, OP. An f-string is one STRING span, as before Python 3.12 split it
    into parts. Raises tokenize.TokenError or SyntaxError on source it cannot read."""
    starts = line_starts(source)

    def offset(pos: tuple[int, int]) -> int:
        return starts[pos[0] - 1] + pos[1]

    spans, depth, fstring_start = [], 0, 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        name = tokenize.tok_name[tok.type]
        if name.endswith("STRING_START"):  # 3.12+: FSTRING_START ... FSTRING_END
            depth += 1
            if depth == 1:
                fstring_start = offset(tok.start)
            continue
        if name.endswith("STRING_END"):
            depth -= 1
            if depth == 0:
                spans.append((fstring_start, offset(tok.end), "STRING"))
            continue
        if depth or name not in ("NAME", "STRING", "NUMBER", "COMMENT", "OP"):
            continue
        if name == "NAME" and keyword.iskeyword(tok.string):
            name = "KEYWORD"
        spans.append((offset(tok.start), offset(tok.end), name))
    return spans


def windows(source: str, spans, window_lines: int):
    """(start, end) character ranges of windows of about `window_lines` lines, each cut at a
    line boundary that no span crosses (a triple-quoted string stays whole)."""
    starts = line_starts(source)
    inside = set()  # line boundaries strictly inside a (multi-line) span
    for s, e, _ in spans:
        inside.update(starts[bisect.bisect_right(starts, s) : bisect.bisect_left(starts, e)])
    i = 0
    while i < len(starts) - 1:
        j = min(i + window_lines, len(starts) - 1)
        while j < len(starts) - 1 and starts[j] in inside:
            j += 1
        yield starts[i], starts[j]
        i = j


def char_tags(text: str, spans) -> list[str]:
    """BIO tags, one per character of `text`: B-X on a span's first character, I-X on the
    rest, O outside every span."""
    tags = ["O"] * len(text)
    for s, e, t in spans:
        tags[s] = f"B-{t}"
        tags[s + 1 : e] = [f"I-{t}"] * (e - s - 1)
    return tags


def token_tags(
    text: str, spans, offsets, rule: Literal["first", "all"] = "first"
) -> list[str | None]:
    """The BIO tag of each token of a tokenizer, from its character offsets into `text`.

    A token takes the tag of its first non-whitespace character (of its first character when
    it is all whitespace): B-X when it starts a span, I-X when it continues one. A token that
    continues a span in the middle of a word (the character before it is not whitespace) is a
    later subword: under rule "first" its tag is None (leave it out of the loss and of the
    metric, label -100), under rule "all" it is I-X. A span that starts inside a token
    already tagged (a BPE token joining two operators, "):") is not seen at token level.
    With a character tokenizer, rule "all" gives `char_tags` exactly.

    Args:
        text: the example's text.
        spans: its (start, end, type) spans.
        offsets: (start, end) character offsets of each token, e.g. `tokenizers`'
            `Encoding.offsets`.
        rule: "first" or "all".

    Returns:
        one tag (or None) per token.
    """
    chars = char_tags(text, spans)
    out = []
    for s, e in offsets:
        if s >= e:  # an empty token (a special one added to the text)
            out.append("O")
            continue
        p = next((i for i in range(s, e) if not text[i].isspace()), s)
        tag = chars[p]
        if tag.startswith("I-") and rule == "first" and not text[p - 1].isspace():
            tag = None
        out.append(tag)
    return out


def spans_from_words(tokens: list[str], tags: list[str]) -> tuple[str, list]:
    """(text, spans) of word-level BIO tags: the words joined by single spaces; an entity
    (B-X then I-X words, or an I-X word after another type, as in CoNLL) is one span."""
    text, spans, pos = " ".join(tokens), [], 0
    for word, tag in zip(tokens, tags):
        start, end = pos, pos + len(word)
        if tag != "O":
            kind = tag[2:]
            if tag.startswith("I-") and spans and spans[-1][2] == kind and spans[-1][1] == pos - 1:
                spans[-1] = (spans[-1][0], end, kind)  # continues the entity (across the space)
            else:
                spans.append((start, end, kind))
        pos = end + 1
    return text, spans


def words_from_spans(text: str, spans) -> tuple[list[str], list[str]]:
    """Words and word-level BIO tags of a tagged text (the inverse of `spans_from_words`, for
    TagTask's {"tokens", "tags"} with word_sep=""): each span is one word tagged B-X, and the
    text between spans is cut into O words at whitespace. Whitespace goes at the end of the
    word before it, so every word starts with its first visible character (where its first
    subword carries the tag) and the words joined give `text` back.

    Args:
        text: the text.  spans: sorted (start, end, type) character spans that do not overlap.

    Returns:
        (tokens, tags), of equal length.
    """
    words: list[list[str]] = []  # [word, tag]

    def gap(part: str) -> None:
        lead = part[: len(part) - len(part.lstrip())]
        if lead:
            if words:
                words[-1][0] += lead
            else:
                words.append([lead, "O"])
        words.extend([w, "O"] for w in re.findall(r"\S+\s*", part[len(lead) :]))

    pos = 0
    for start, end, kind in spans:
        gap(text[pos:start])
        words.append([text[start:end], f"B-{kind}"])
        pos = end
    gap(text[pos:])
    return [w for w, _ in words], [t for _, t in words]
