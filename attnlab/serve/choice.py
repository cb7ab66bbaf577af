"""One choice of a request: the engine's events for it, turned into text as they come.

Text is decoded incrementally and stop strings are searched in the new text only
(inference/text.py, the same code `generate_text` uses), so each token costs a decode of a
handful of ids, not of the whole answer. A stream also holds back a tail that could still become
a stop string, so the stop string and what follows it are never sent.
"""

import asyncio
from collections.abc import AsyncIterator, Callable

from attnlab.inference.text import IncrementalDecoder, StopStrings
from attnlab.serve.types import Request, TokenEvent


class Choice:
    """The events of one engine request (see the module docstring).

    Args:
        index: the choice's index in the response.
        request: the engine request.
        tokenizer: decodes the tokens (attnlab.tokenizer.Tokenizer).
        cancel: called with the request id when a stop string ends the choice before the
            engine has seen it.
        echo_ids: the prompt, when the response starts with it (echo).
    """

    def __init__(
        self,
        index: int,
        request: Request,
        tokenizer,
        cancel: Callable[[str], None],
        echo_ids: tuple[int, ...] = (),
    ):
        self.index, self.request, self.tokenizer, self.cancel = index, request, tokenizer, cancel
        self.echo_ids = echo_ids
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.tokens: list[int] = []
        self.logprobs: list[float | None] = []
        self.top: list[dict[int, float] | None] = []
        self.prompt_logprobs: tuple[float | None, ...] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""  # decoded so far (cut before a stop string once one is found)
        self._decoder = IncrementalDecoder(tokenizer.decode)
        self._stops = StopStrings(request.params.stop)
        self._stopped = False  # a stop string was found: the text is final
        self._sent = 0  # characters of `text` already streamed
        self._sent_tokens = 0

    # --- events in ----------------------------------------------------------------------------
    def take(self, event: TokenEvent) -> bool:
        """Record an event; True when the choice has finished (a stop string counts)."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.token_id is not None:
            self.tokens.append(event.token_id)
            self.logprobs.append(event.logprob)
            self.top.append(event.top_logprobs)
            self._decode(final=False)
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
            self._decode(final=True)
        if not self._stopped and self._cut_at_stop():
            self._stopped = True
            if self.finish_reason is None:  # the engine has not seen it yet
                self.cancel(self.request.request_id)
            self.finish_reason = "stop"
        return self.finish_reason is not None

    def _decode(self, final: bool) -> None:
        """Append the text of the tokens not yet decoded (all of it when `final`)."""
        if self._stopped:  # the text ended at a stop string
            return
        if not final:
            self.text += self._decoder.push(self.tokens[-1])
        else:
            self.text += self._decoder.flush()

    def _cut_at_stop(self) -> bool:
        """Cut `text` before the first stop string in it, if there is one."""
        at = self._stops.find(self.text)
        if at is not None:
            self.text = self.text[:at]
        return at is not None

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The engine's events up to the one that finishes the choice."""
        while True:
            event = await self.queue.get()
            done = self.take(event)
            yield event
            if done:
                return

    # --- text out -----------------------------------------------------------------------------
    def delta(self) -> str:
        """The text not streamed yet: all of it once finished, else what no stop string can
        still claim."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self._stops.held(self.text)
        new, self._sent = self.text[self._sent : max(end, self._sent)], max(end, self._sent)
        return new

    def new_tokens(self) -> slice:
        """The tokens not streamed yet (their log-probs go with the next chunk)."""
        new = slice(self._sent_tokens, len(self.tokens))
        self._sent_tokens = len(self.tokens)
        return new
