"""The OpenAI-compatible HTTP API over an engine (types.py), on Starlette/FastAPI.

    POST /v1/completions        prompt text or token ids (or a list of either), n, stop, seed,
                                stream, logprobs, echo (echo + logprobs: the prompt's log-probs,
                                which is how lm-eval's `local-completions` scores)
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models  /health  /metrics (Prometheus text)
    GET  /tokenizer_info   POST /tokenize  /detokenize   (vLLM's, so lm-eval can tokenize remotely)

Each choice of a request is one engine request. The engine calls `on_event` from its own thread;
the event is handed to the request's asyncio queue with `call_soon_threadsafe`. Text is decoded
from all of a choice's tokens so far, so a character split over tokens comes out whole; a stream
holds back a tail that could still become a stop string (the stop string and what follows it are
never returned). A client gone mid-request has its engine requests cancelled.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so the `openai`
client raises its typed exceptions: 400 bad input, 401 a wrong or missing API key, 404 an
unknown route, 429 the engine's queue is full, 503 the server is stopping.
"""

import asyncio
import errno
import itertools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnlab.serve.types import EngineStopped, QueueFull, SamplingParams, TokenEvent
from attnlab.serve.types import Request as EngineRequest

MAX_BODY_BYTES = 4 * 2**20  # a request body beyond this is refused before it is parsed
MAX_N = 16  # choices per prompt
MAX_STOP = 4  # stop strings, as OpenAI
MAX_LOGPROBS = 20  # alternatives per token
POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.TYPES.get(self.status, "server_error")}
        body |= {"param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# --- reading a request ----------------------------------------------------------------------------
def _get(body: dict, name: str, kind, default, check=None, rule: str = ""):
    """body[name] (or `default` when absent or null), of type `kind` and passing `check`."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok or (check is not None and not check(value)):
        raise APIError(400, f"{name} must be {rule}, got {value!r}", name)
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    return tuple(stop)


@dataclass
class Settings:
    """What the server knows beside the engine."""

    model_name: str
    context: int  # prompt + generated tokens, at most
    vocab_size: int
    api_key: str | None = None
    stop_timeout: float = 10.0
    created: int = field(default_factory=lambda: int(time.time()))


# --- one choice: the events of one engine request, turned into text -------------------------------
class Choice:
    """Collects one engine request's events; `delta()` gives the text that is safe to send."""

    def __init__(self, app_state, index: int, request: EngineRequest, echo_ids=()):
        self.state, self.index, self.request = app_state, index, request
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.tokens: list[int] = []
        self.logprobs: list[float | None] = []
        self.top: list[dict[int, float] | None] = []
        self.prompt_logprobs: tuple[float | None, ...] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.sent = ""  # text already streamed
        self.sent_tokens = 0
        self.echo_ids = tuple(echo_ids)

    @property
    def stop(self) -> tuple[str, ...]:
        return self.request.params.stop

    def text(self) -> tuple[str, bool]:
        """(the text so far, cut before a stop string; whether a stop string was found)."""
        text = self.state.tokenizer.decode(self.tokens)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def take(self, event: TokenEvent) -> bool:
        """Record an event; True when the choice is finished (a stop string counts)."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.token_id is not None:
            self.tokens.append(event.token_id)
            self.logprobs.append(event.logprob)
            self.top.append(event.top_logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
            return True
        if self.stop and self.text()[1]:  # the engine may not have seen it yet
            self.finish_reason = "stop"
            self.state.engine.cancel(self.request.request_id)
            return True
        return False

    def delta(self) -> str:
        """New text to stream: all of it once finished, else what no stop string can still
        claim and no split character is still missing from."""
        text, _ = self.text()
        if self.finish_reason is None:
            hold = max(
                (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                default=0,
            )
            text = text[: len(text) - hold]
            text = text.rstrip("\ufffd")  # a multi-byte character not complete yet
        if not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The engine's events until the finish (the one with finish_reason included)."""
        while True:
            event = await self.queue.get()
            done = self.take(event)
            yield event
            if done:
                return


# --- the app --------------------------------------------------------------------------------------
def create_app(engine, tokenizer, settings: Settings) -> FastAPI:
    """The FastAPI app serving `engine` (started and stopped by the app's lifespan)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        app.state.stopping = True
        await asyncio.to_thread(engine.stop, settings.stop_timeout)

    app = FastAPI(title="attnlab", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.tokenizer, app.state.settings = engine, tokenizer, settings
    app.state.stopping = False
    app.state.http = {}  # status code -> count
    ids = itertools.count()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if settings.api_key and not path.startswith(("/health", "/metrics")):
            if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
                e = APIError(401, "a wrong or missing API key: send Authorization: Bearer KEY")
                response = e.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                _count(app, 401)
                return response
        response = await call_next(request)
        _count(app, response.status_code)
        return response

    @app.get("/health")
    async def health():
        if app.state.stopping:
            raise APIError(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.model_name, "object": "model", "created": settings.created}
        card |= {"owned_by": "attnlab", "max_model_len": settings.context}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.stats(), app.state.http))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        names = {k: tokenizer.token_id(v) for k, v in SPECIAL_NAMES.items()}
        info = {k: _token_text(tokenizer, i) if i is not None else None for k, i in names.items()}
        return info | {
            "chat_template": tokenizer.chat_template,
            "model_max_length": settings.context,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "prompt must be a string", "prompt")
        tokens = tokenizer.encode(prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": settings.context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        return {"prompt": tokenizer.decode(_token_ids(body.get("tokens"), settings, "tokens"))}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        _check_model(body, settings)
        prompts = _prompts(body, tokenizer, settings)
        echo = _get(body, "echo", bool, False, rule="a boolean")
        k = _get(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, "in [0, 20]")
        params = _params(body, settings, logprobs=k, prompt_logprobs=echo and k is not None)
        if params.max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = _submit(app, rid, prompts, params, _get_n(body), echo, next(ids))
        if _get(body, "stream", bool, False, rule="a boolean"):
            return _sse(_stream_completion(app, rid, choices, body, k, echo))
        await _wait_all(request, app, choices)
        out = [_completion_choice(tokenizer, c, k) for c in choices]
        return _envelope(rid, "text_completion", settings, out, _usage(choices, prompts))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        _check_model(body, settings)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list of messages", "messages")
        try:
            text = tokenizer.apply_chat_template(_plain_messages(messages))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        prompts = [_check_length(tokenizer.encode(text), settings, "messages")]
        want = _get(body, "logprobs", bool, False, rule="a boolean")
        k = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= MAX_LOGPROBS, "in [0, 20]")
        params = _params(body, settings, logprobs=k if want else None, chat=True)
        if params.max_tokens == 0:
            raise APIError(400, "max_tokens must be >= 1, got 0", "max_tokens")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = _submit(app, rid, prompts, params, _get_n(body), False, next(ids))
        if _get(body, "stream", bool, False, rule="a boolean"):
            return _sse(_stream_chat(app, rid, choices, body, want))
        await _wait_all(request, app, choices)
        out = [_chat_choice(tokenizer, c, want) for c in choices]
        return _envelope(rid, "chat.completion", settings, out, _usage(choices, prompts))

    return app


SPECIAL_NAMES = {"eos_token": "<eos>", "bos_token": "<bos>", "pad_token": "<pad>"}


def _count(app: FastAPI, status: int) -> None:
    app.state.http[status] = app.state.http.get(status, 0) + 1


def _token_text(tokenizer, token_id: int) -> str:
    """A token's text; a piece of a multi-byte character (no text alone) is named by the
    vocabulary's own string for it, so distinct tokens keep distinct keys in top_logprobs."""
    text = tokenizer.decode([token_id], skip_special=False)
    if "\ufffd" in text:
        return tokenizer.backend.id_to_token(token_id) or text
    return text


async def _json(request: Request) -> dict:
    """The request body as a JSON object; 400 for a body too large, malformed or not an object."""
    size = int(request.headers.get("content-length") or 0)
    chunks, seen = [], 0
    if size <= MAX_BODY_BYTES:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_BODY_BYTES:
                break
            chunks.append(chunk)
    if max(size, seen) > MAX_BODY_BYTES:
        message = f"the request body is over {MAX_BODY_BYTES} bytes: send a shorter prompt"
        raise APIError(400, message, "prompt", "context_length_exceeded")
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _check_model(body: dict, settings: Settings) -> None:
    model = body.get("model", settings.model_name)
    if model != settings.model_name:
        message = f"model {model!r} is not served here: use {settings.model_name!r}"
        raise APIError(400, message, "model", "model_not_found")


def _token_ids(value, settings: Settings, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise APIError(400, f"{param} must be a list of token ids", param)
    bad = [t for t in value if not 0 <= t < settings.vocab_size]
    if bad:
        message = f"token id {bad[0]} is outside the vocabulary [0, {settings.vocab_size})"
        raise APIError(400, message, param)
    return value


def _check_length(ids: list[int], settings: Settings, param: str) -> list[int]:
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token", param)
    if len(ids) >= settings.context:
        message = (
            f"the prompt has {len(ids)} tokens; this model's context is {settings.context}: "
            "shorten it"
        )
        raise APIError(400, message, param, "context_length_exceeded")
    return ids


def _prompts(body: dict, tokenizer, settings: Settings) -> list[list[int]]:
    """The prompts of a completion request as token ids: a string, a list of ids, or a list
    of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt is required (text or token ids)", "prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be text, token ids, or a non-empty list of them", "prompt")
    out = []
    for p in prompt:
        ids = tokenizer.encode(p) if isinstance(p, str) else _token_ids(p, settings, "prompt")
        out.append(_check_length(ids, settings, "prompt"))
    return out


def _plain_messages(messages: list) -> list[dict[str, str]]:
    """Chat messages with text content (OpenAI's list-of-parts content joined)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must have a role and content", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be text", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _get_n(body: dict) -> int:
    return _get(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}]")


def _params(body: dict, settings: Settings, *, logprobs, prompt_logprobs=False, chat=False):
    """SamplingParams from the request (400 naming the field for a bad value)."""
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    limit = settings.context - 1
    max_tokens = _get(body, name, int, 16, lambda v: 0 <= v <= limit, f"in [1, {limit}]")
    temperature = _get(body, "temperature", float, 1.0, lambda v: 0 <= v <= 2, "in [0, 2]")
    top_p = _get(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    seed = _get(body, "seed", int, None, rule="an integer")
    stop_ids = tuple(_token_ids(body.get("stop_token_ids") or [], settings, "stop_token_ids"))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=_stop_strings(body),
        stop_token_ids=stop_ids,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _submit(app, rid: str, prompts, params: SamplingParams, n: int, echo: bool, serial: int):
    """One engine request per prompt and choice; the n choices of a seeded request get seeds
    seed, seed + 1, ... (different, and each reproducible)."""
    engine, settings, tokenizer = app.state.engine, app.state.settings, app.state.tokenizer
    loop = asyncio.get_running_loop()
    stops = _default_stop_ids(tokenizer, chat=rid.startswith("chat"))
    choices = []
    try:
        for i, (p, j) in enumerate(itertools.product(range(len(prompts)), range(n))):
            ids = prompts[p]
            if len(ids) + params.max_tokens > settings.context:
                message = (
                    f"the prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                    f"exceeds this model's context of {settings.context} tokens"
                )
                raise APIError(400, message, "max_tokens", "context_length_exceeded")
            seed = None if params.seed is None else params.seed + j
            choice_params = _replace(
                params, seed=seed, stop_token_ids=params.stop_token_ids + stops
            )
            request = EngineRequest(f"{rid}-{i}", tuple(ids), choice_params)
            choice = Choice(app.state, i, request, ids if echo else ())

            def on_event(event, queue=choice.queue):
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                except RuntimeError:  # the event loop is closed: nobody is listening
                    pass

            engine.submit(request, on_event)
            choices.append(choice)
    except (QueueFull, EngineStopped, ValueError, APIError) as e:
        for c in choices:
            engine.cancel(c.request.request_id)
        if isinstance(e, APIError):
            raise
        status = {QueueFull: 429, EngineStopped: 503}.get(type(e), 400)
        raise APIError(status, str(e)) from None
    return choices


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(params, **changes)


def _default_stop_ids(tokenizer, chat: bool) -> tuple[int, ...]:
    """<eos> ends every request; a chat reply also ends at the template's <|end|>."""
    names = ["<eos>", "<|end|>"] if chat else ["<eos>"]
    return tuple(i for i in (tokenizer.token_id(n) for n in names) if i is not None)


async def _wait_all(request: Request, app, choices: list[Choice]) -> None:
    """Run every choice to its end; cancel them all if the client goes away."""

    async def drain(c: Choice):
        async for _ in c.events():
            pass

    task = asyncio.gather(*(drain(c) for c in choices))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                task.result()
                break
            if await request.is_disconnected():
                raise asyncio.CancelledError
    finally:
        _cancel_unfinished(app, choices)
    _raise_engine_error(choices)


def _cancel_unfinished(app, choices: list[Choice]) -> None:
    for c in choices:
        if c.finish_reason is None:
            app.state.engine.cancel(c.request.request_id)


def _raise_engine_error(choices: list[Choice]) -> None:
    for c in choices:
        if c.finish_reason == "error":
            raise APIError(500, f"generation failed: {c.error}", code="engine_error")
        if c.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled (the server is stopping)")


def _usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.tokens) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _envelope(rid: str, kind: str, settings: Settings, choices: list, usage) -> dict:
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": settings.model_name}
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    return out


def _finish(c: Choice) -> str | None:
    return {"cancelled": "stop"}.get(c.finish_reason, c.finish_reason)


# --- completions: the OpenAI text_completion shape ---------------------------------------------
def _completion_logprobs(tokenizer, c: Choice, k: int | None, tokens, lps, tops, offset=0):
    """OpenAI's legacy logprobs object for `tokens`: strings, log-probs, top alternatives, and
    each token's character offset from `offset`."""
    strings = [_token_text(tokenizer, t) for t in tokens]
    offsets = list(itertools.accumulate([offset] + [len(s) for s in strings[:-1]]))[: len(strings)]
    top = [
        None if d is None else {_token_text(tokenizer, i): v for i, v in d.items()} for d in tops
    ]
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def _echo_logprobs(tokenizer, c: Choice):
    """The prompt's part of an echo: token i's log p given the tokens before it (None for the
    first). The engine reports no alternatives for prompt tokens: each position's top_logprobs
    holds the prompt token alone."""
    ids = list(c.echo_ids)
    lps = list(c.prompt_logprobs or [None] * len(ids))
    if len(lps) == len(ids) - 1:
        lps = [None, *lps]
    tops = [None if lp is None else {t: lp} for t, lp in zip(ids, lps)]
    return ids, lps, tops


def _completion_choice(tokenizer, c: Choice, k: int | None) -> dict:
    text, _ = c.text()
    logprobs = None
    if k is not None:
        tokens, lps, tops = list(c.tokens), list(c.logprobs), list(c.top)
        if c.echo_ids:
            ids, plps, ptops = _echo_logprobs(tokenizer, c)
            tokens, lps, tops = ids + tokens, plps + lps, ptops + tops
        logprobs = _completion_logprobs(tokenizer, c, k, tokens, lps, tops)
    if c.echo_ids:
        text = tokenizer.decode(c.echo_ids) + text
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": _finish(c)}


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """The events of all choices as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        async for event in c.events():
            await queue.put((c, event))
        await queue.put((c, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        open_ = len(choices)
        while open_:
            c, event = await queue.get()
            if event is None:
                open_ -= 1
            else:
                yield c, event
    finally:
        for t in tasks:
            t.cancel()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        async for chunk in events:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(lines(), media_type="text/event-stream", headers=headers)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


async def _stream_completion(app, rid, choices, body, k, echo) -> AsyncIterator[dict]:
    settings, tokenizer = app.state.settings, app.state.tokenizer

    def chunk(index, text, logprobs=None, finish=None):
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return _envelope(rid, "text_completion", settings, [choice], None)

    try:
        if echo and k is None:  # with logprobs, the echo waits for the prompt's log-probs
            for c in choices:
                yield chunk(c.index, tokenizer.decode(c.echo_ids))
        async for c, event in _merged(choices):
            if event.prompt_logprobs is not None and echo and k is not None:
                ids, plps, ptops = _echo_logprobs(tokenizer, c)
                logprobs = _completion_logprobs(tokenizer, c, k, ids, plps, ptops)
                yield chunk(c.index, tokenizer.decode(c.echo_ids), logprobs)
            if c.finish_reason == "error":
                yield {
                    "error": {"message": f"generation failed: {c.error}", "type": "server_error"}
                }
                return
            text = c.delta()
            new = range(c.sent_tokens, len(c.tokens))
            c.sent_tokens = len(c.tokens)
            logprobs = None
            if k is not None and len(new):
                tokens, lps, tops = (
                    c.tokens[new.start :],
                    c.logprobs[new.start :],
                    c.top[new.start :],
                )
                logprobs = _completion_logprobs(tokenizer, c, k, tokens, lps, tops)
            finish = _finish(c)
            if text or logprobs or finish:
                yield chunk(c.index, text, logprobs, finish)
        if _include_usage(body):
            prompts = [list(c.request.prompt_ids) for c in choices]
            yield _envelope(rid, "text_completion", settings, [], _usage(choices, prompts))
    finally:
        _cancel_unfinished(app, choices)


# --- chat: the OpenAI chat.completion shape -------------------------------------------------------
def _chat_logprobs(tokenizer, tokens, lps, tops) -> dict:
    def entry(t, lp):
        s = _token_text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for t, lp, top in zip(tokens, lps, tops):
        alternatives = [entry(i, v) for i, v in (top or {}).items()]
        content.append(entry(t, lp) | {"top_logprobs": alternatives})
    return {"content": content}


def _chat_choice(tokenizer, c: Choice, want: bool) -> dict:
    text, _ = c.text()
    logprobs = _chat_logprobs(tokenizer, c.tokens, c.logprobs, c.top) if want else None
    message = {"role": "assistant", "content": text}
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": _finish(c)}


async def _stream_chat(app, rid, choices, body, want) -> AsyncIterator[dict]:
    settings, tokenizer = app.state.settings, app.state.tokenizer

    def chunk(index, delta, logprobs=None, finish=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _envelope(rid, "chat.completion.chunk", settings, [choice], None)

    try:
        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for c, _event in _merged(choices):
            if c.finish_reason == "error":
                yield {
                    "error": {"message": f"generation failed: {c.error}", "type": "server_error"}
                }
                return
            text = c.delta()
            new = slice(c.sent_tokens, len(c.tokens))
            c.sent_tokens = len(c.tokens)
            logprobs = None
            if want and c.tokens[new]:
                logprobs = _chat_logprobs(tokenizer, c.tokens[new], c.logprobs[new], c.top[new])
            finish = _finish(c)
            if text or logprobs or finish:
                yield chunk(c.index, {"content": text} if text else {}, logprobs, finish)
        if _include_usage(body):
            prompts = [list(c.request.prompt_ids) for c in choices]
            yield _envelope(rid, "chat.completion.chunk", settings, [], _usage(choices, prompts))
    finally:
        _cancel_unfinished(app, choices)


# --- /metrics -------------------------------------------------------------------------------------
def prometheus_text(stats: dict[str, float], http: dict[int, int]) -> str:
    """Prometheus' text format: the engine's stats (names ending in _total are counters,
    time_to_first_token_seconds a summary, the rest gauges) and the HTTP responses by code."""
    lines = [
        "# HELP attnlab_http_responses_total HTTP responses by status code.",
        "# TYPE attnlab_http_responses_total counter",
    ]
    lines += [f'attnlab_http_responses_total{{code="{k}"}} {v}' for k, v in sorted(http.items())]
    summaries = {k.rsplit("_", 1)[0] for k in stats if k.endswith(("_sum", "_count"))}
    for name in sorted(summaries):
        lines += [f"# TYPE attnlab_{name} summary"]
        lines += [
            f"attnlab_{name}_{part} {stats.get(f'{name}_{part}', 0)}" for part in ("sum", "count")
        ]
    for key, value in sorted(stats.items()):
        if key.rsplit("_", 1)[0] in summaries:
            continue
        counter = key.endswith("_total") and not key.startswith("kv_blocks")  # a pool size
        kind = "counter" if counter else "gauge"
        lines += [f"# TYPE attnlab_{key} {kind}", f"attnlab_{key} {value}"]
    return "\n".join(lines) + "\n"


# --- running it -----------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); a port in use is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is in use: choose another with --port"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    return sock


def run_server(app: FastAPI, sock: socket.socket, stop_timeout: float = 10.0) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM: uvicorn stops accepting, lets open requests
    finish for up to `stop_timeout` s, then the lifespan stops the engine (`engine.stop`)."""
    import signal
    import threading

    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=stop_timeout, access_log=False
    )
    if threading.current_thread() is not threading.main_thread():
        uvicorn.Server(config).run(sockets=[sock])
        return
    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown was
    # clean, so the re-raised signal is ignored and the process exits 0.
    signals = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
