"""Text from tokens as they come: incremental detokenization and stop strings, the one home of
both for `generate`/`generate_text` (inference/generate.py) and the server (serve/choice.py).

Incremental detokenization (as TGI and vLLM do it). Decoding the whole answer again at every
token costs O(N) a token, O(N^2) an answer. Instead each new token's text is the decoding of a
few tokens back to it minus the decoding of those few tokens:

    tokens   t0 t1 ... t_prefix ... t_read ... t_new
                       └─ before ──┘                    before = decode(tokens[prefix:read])
                       └─ after ──────────────────┘     after  = decode(tokens[prefix:])
                                                        new text = after[len(before):]

Why a window and not the new tokens alone: a decoder may write a token differently at the
start of a text (SentencePiece's leading space), and a multi-byte UTF-8 character may be split
across byte-level BPE tokens. While `after` ends in U+FFFD (an incomplete character) the new
text is kept back; once it is complete, `prefix` moves to `read` and `read` to the end. Both
offsets then sit where a character ends, so the pieces add up to the full decoding.

Stop strings: `StopStrings.find` searches only the text added since its last call plus the
len(longest) - 1 characters before it, so a string split across tokens is found and a token
costs its own text, not the whole answer's. `StopStrings.held` is how much of a text's end could
still grow into a stop string (a stream keeps it back until it cannot).
"""

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decoding gives for an incomplete UTF-8 sequence


class IncrementalDecoder:
    """The text of a growing list of token ids, decoded a few ids at a time.

    Args:
        decode: token ids -> text (e.g. `Tokenizer.decode`).

    Attributes:
        tokens: the ids pushed so far.  text: their text, less a trailing incomplete character
            (all of it after `flush`).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # token offsets of the window (module docstring)

    def push(self, token: int) -> str:
        """Add one token id; returns the text it completes ("" while a character is open)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character, written as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.decode(self.tokens[self._prefix : self._read])
        after = self.decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or (not final and after.endswith(REPLACEMENT)):
            return ""
        new = after[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(self.tokens)
        return new


class StopStrings:
    """Finds the first of `stops` in a growing text, searching each part of it once.

    Args:
        stops: the stop strings (none: `find` always answers None and `held` 0).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._longest = max(map(len, self.stops), default=0)
        self._searched = 0  # text before this offset holds no stop string

    def find(self, text: str) -> int | None:
        """Where the first stop string starts in `text` (which only grew since the last call);
        None when there is none yet."""
        if not self.stops:
            return None
        start = max(0, self._searched - self._longest + 1)
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self._searched = len(text)
        return min(found) if found else None

    def held(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string (it could still
        become one, so a stream does not send it yet)."""
        ends = (
            next((k for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), 0)
            for s in self.stops
        )
        return max(ends, default=0)


def shortest_with_stop(tokens: list[int], stops: Sequence[str], decode) -> bool:
    """If the text of `tokens` contains a stop string, drop the tokens after the one that
    completes it (in place) and answer True. Decodes once per dropped token: for a finished
    sequence (beam search's), or after `StopStrings` found one in a stream."""
    if not any(s in decode(tokens) for s in stops):
        return False
    while len(tokens) > 1 and any(s in decode(tokens[:-1]) for s in stops):
        tokens.pop()  # the string was already complete without the last token
    return True
