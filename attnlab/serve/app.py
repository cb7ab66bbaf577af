"""The OpenAI-compatible HTTP API over an engine (types.py), on FastAPI (Starlette) and uvicorn.

    POST /v1/completions        prompt text or token ids (or a list of either), n, stop, seed,
                                stream, logprobs, echo (echo + logprobs: the prompt's log-probs,
                                which is how lm-eval's `local-completions` scores)
    POST /v1/chat/completions   messages through the tokenizer's chat template
                                (both take the whole sampler: temperature, top_p, top_k, min_p,
                                the penalties, logit_bias, min_tokens, ignore_eos)
    GET  /v1/models  /health  /metrics (Prometheus text)
    GET  /props                 the chat defaults of the sampler and the context (llama.cpp's
                                route and field names), which the chat page shows
    GET  /tokenizer_info   POST /tokenize  /detokenize   (vLLM's, so lm-eval can tokenize remotely)
    POST /v1/attention          a chat reply's (or a text's) attention maps as the viewer's
                                HTML page (attention.py: the fields, and why the forward runs
                                as a job on the engine's thread)
    GET  /                      the chat page (static/chat.html; off with `--no-ui`): plain
                                HTML/JS that reads /v1/models and /props, streams
                                /v1/chat/completions and opens a reply's /v1/attention page,
                                fetching nothing else

Each choice of a request is one engine request. The engine calls `on_event` from its own thread;
the event is handed to the choice's asyncio queue with `call_soon_threadsafe` (choice.py turns
events into text). Streams are server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`. A client gone mid-request has its engine requests cancelled: a stream's
generator is closed by Starlette, a plain request polls for the disconnect.

Request parsing and the response objects are in protocol.py; errors there and here are
`APIError`s, answered in OpenAI's shape.
"""

import asyncio
import contextlib
import errno
import itertools
import json
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from attnlab.inference.constraints import check_room
from attnlab.serve import protocol as wire
from attnlab.serve.attention import attention_ask, page_data
from attnlab.serve.choice import Choice
from attnlab.serve.protocol import APIError, Settings
from attnlab.serve.tools import (
    CallSplitter,
    ToolError,
    Tools,
    call_constraint,
    fallback_messages,
    parsed_reply,
    requested_tools,
)
from attnlab.serve.types import EngineStopped, QueueFull, SamplingParams
from attnlab.serve.types import Request as EngineRequest
from attnlab.viz.viewer import viewer_html

POLL_S = 0.5  # how often a plain (non-streaming) request checks that its client is still there
OPEN_PATHS = ("/health", "/metrics")  # need no API key (probes and scrapers on loopback)
PAGE = "/"  # the chat page: open too (it holds no data; it asks for the key and sends it)
GONE = 499  # nginx's "client closed request": the status of an answer nobody reads
SPECIAL_NAMES = {"eos_token": "<eos>", "bos_token": "<bos>", "pad_token": "<pad>"}


class Guard:
    """ASGI middleware: a 503 once the server is stopping, the API key check (401), and the
    count of responses by status code."""

    def __init__(self, app, settings: Settings, counts: dict[int, int]):
        self.app, self.settings, self.counts = app, settings, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["app"].state.stopping:  # set at the signal (run_server), before the engine's
            error = APIError(503, "the server is stopping: send the request to another one")
            response = JSONResponse(error.body(), 503, {"Connection": "close"})
            self.counts[503] = self.counts.get(503, 0) + 1
            return await response(scope, receive, send)
        key = self.settings.api_key
        path = scope["path"]
        if key and path != PAGE and not path.startswith(OPEN_PATHS):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"") != f"Bearer {key}".encode():
                error = APIError(401, "a wrong or missing API key: send Authorization: Bearer KEY")
                response = JSONResponse(error.body(), 401, {"WWW-Authenticate": "Bearer"})
                self.counts[401] = self.counts.get(401, 0) + 1
                return await response(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counts[message["status"]] = self.counts.get(message["status"], 0) + 1
            await send(message)

        await self.app(scope, receive, counted)


def create_app(engine, tokenizer, settings: Settings) -> FastAPI:
    """The app serving `engine`; its lifespan starts the engine and, at shutdown, stops it
    (`engine.stop(settings.stop_timeout)`). The routes below read the engine, tokenizer and
    settings from `request.app.state`."""
    app = FastAPI(title="attnlab", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.tokenizer, app.state.settings = engine, tokenizer, settings
    app.state.counts = {}  # responses by status code, for /metrics
    app.state.stopping = False  # run_server sets it at SIGINT/SIGTERM: every request then a 503
    app.add_middleware(Guard, settings=settings, counts=app.state.counts)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    for path, endpoint in ROUTES["GET"].items():
        app.add_api_route(path, endpoint, methods=["GET"])
    if settings.ui:
        app.add_api_route(PAGE, chat_page, methods=["GET"], response_class=HTMLResponse)
    for path, endpoint in ROUTES["POST"].items():
        app.add_api_route(path, endpoint, methods=["POST"])
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    engine = app.state.engine
    engine.start()
    yield
    await asyncio.to_thread(engine.stop, app.state.settings.stop_timeout)


async def api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), e.status)


async def http_error(request: Request, e: StarletteHTTPException):
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code)


async def client_gone(request: Request, e: ClientDisconnect):
    """A client gone before its body arrived whole (or dropped at a stop): nobody to answer."""
    return Response(status_code=GONE)


# --- the small routes -----------------------------------------------------------------------------
async def health():
    return {"status": "ok"}


async def models(request: Request):
    """The base, then each LoRA adapter with the base as its parent (as vLLM lists them)."""
    settings = request.app.state.settings
    card = {"id": settings.model_name, "object": "model", "created": settings.created}
    card |= {"owned_by": "attnlab", "max_model_len": settings.context}
    cards = [card | {"root": settings.model_name, "parent": None}]
    for name, path in settings.adapters.items():
        cards.append(card | {"id": name, "root": path, "parent": settings.model_name})
    return {"object": "list", "data": cards}


async def props(request: Request):
    return wire.props(request.app.state.settings)


async def metrics(request: Request):
    state = request.app.state
    return PlainTextResponse(wire.prometheus_text(state.engine.stats(), state.counts))


async def tokenizer_info(request: Request):
    tokenizer, settings = request.app.state.tokenizer, request.app.state.settings
    ids = {k: tokenizer.token_id(v) for k, v in SPECIAL_NAMES.items()}
    info = {k: None if i is None else wire.token_text(tokenizer, i) for k, i in ids.items()}
    return info | {"chat_template": tokenizer.chat_template, "model_max_length": settings.context}


async def tokenize(request: Request):
    tokenizer, settings = request.app.state.tokenizer, request.app.state.settings
    prompt = (await read_body(request)).get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string", "prompt")
    tokens = await encode(tokenizer, prompt)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": settings.context}


async def detokenize(request: Request):
    tokenizer, settings = request.app.state.tokenizer, request.app.state.settings
    tokens = wire.token_ids((await read_body(request)).get("tokens"), settings, "tokens")
    return {"prompt": tokenizer.decode(tokens)}


async def chat_page():
    """The chat page, read from the package (pyproject ships static/ as package data)."""
    page = files("attnlab.serve").joinpath("static", "chat.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


# --- the two generating routes --------------------------------------------------------------------
async def completions(request: Request):
    app = request.app
    tokenizer, settings = app.state.tokenizer, app.state.settings
    body = await read_body(request)
    model, adapter = wire.requested_model(body, settings)
    prompts = [await prompt_ids(p, tokenizer, settings) for p in wire.raw_prompts(body)]
    echo = wire.field_of(body, "echo", bool, False, rule="a boolean")
    rule = f"in [0, {wire.MAX_LOGPROBS}]"
    k = wire.field_of(body, "logprobs", int, None, lambda v: 0 <= v <= wire.MAX_LOGPROBS, rule)
    scored = echo and k is not None  # the prompt's log-probs come back too
    params = wire.sampling_params(body, settings, logprobs=k, prompt_logprobs=scored, chat=False)
    n, stream = wire.choices_per_prompt(body), wire.streamed(body)
    check_constraint_room(app, params, prompts, wire.constraint_field(body), chat=False)
    rid = f"cmpl-{uuid.uuid4().hex}"
    choices = submit(app, rid, prompts, params, n, echo, chat=False, adapter=adapter)
    if stream:
        return sse(stream_completion(app, rid, choices, body, k, echo), app, choices)
    if not await wait_all(request, app, choices):
        return Response(status_code=GONE)
    out = [wire.completion_choice(tokenizer, c, k) for c in choices]
    return wire.envelope(rid, "text_completion", model, out, usage_of(choices, prompts))


async def chat(request: Request):
    app = request.app
    tokenizer, settings = app.state.tokenizer, app.state.settings
    body = await read_body(request)
    model, adapter = wire.requested_model(body, settings)
    try:
        tools = requested_tools(body)
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    text = chat_prompt(tokenizer, wire.chat_messages(body), tools)
    prompts = [wire.check_prompt_length(await encode(tokenizer, text), settings, "messages")]
    want = wire.field_of(body, "logprobs", bool, False, rule="a boolean")
    rule = f"in [0, {wire.MAX_LOGPROBS}]"
    k = wire.field_of(body, "top_logprobs", int, 0, lambda v: 0 <= v <= wire.MAX_LOGPROBS, rule)
    if k and not want:  # as OpenAI: the alternatives come with the log-probs or not at all
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    k = k if want else None
    params = wire.sampling_params(body, settings, logprobs=k, prompt_logprobs=False, chat=True)
    field = wire.constraint_field(body)
    if tools is not None and tools.forced:
        if params.constraint is not None:
            message = f"tool_choice {tools.mode} constrains the reply already: drop the other"
            raise APIError(400, message, "tool_choice")
        params, field = replace(params, constraint=call_constraint(tools)), "tools"
    check_constraint_room(app, params, prompts, field, chat=True)
    n, stream = wire.choices_per_prompt(body), wire.streamed(body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = submit(app, rid, prompts, params, n, False, chat=True, adapter=adapter)
    if stream:
        return sse(stream_chat(app, rid, choices, body, want, tools), app, choices)
    if not await wait_all(request, app, choices):
        return Response(status_code=GONE)
    out = [wire.chat_choice(tokenizer, c, want, tools) for c in choices]
    return wire.envelope(rid, "chat.completion", model, out, usage_of(choices, prompts))


def chat_prompt(tokenizer, messages: list[dict], tools: Tools | None) -> str:
    """The conversation rendered by the chat template, with the tools passed to a template
    that reads them, else shown by tools.py's fallback system message."""
    specs = None
    if tools is not None and tokenizer.takes_tools:
        specs = list(tools.specs)
    elif tools is not None:
        messages = fallback_messages(messages, tools)
    try:
        return tokenizer.apply_chat_template(messages, tools=specs)
    except ValueError as e:  # no chat template
        raise APIError(400, str(e), "messages") from None


# --- attention maps -------------------------------------------------------------------------------
async def attention(request: Request):
    """The viewer page of a chat reply's (or a text's) attention maps: attention.py checks the
    request and makes the page's data in a job on the engine's thread."""
    app = request.app
    tokenizer, engine, settings = app.state.tokenizer, app.state.engine, app.state.settings
    body = await read_body(request)
    ids, param = await attention_ids(body, tokenizer)
    ask = attention_ask(body, ids, param, engine.model, settings)
    try:
        data = await asyncio.wrap_future(
            engine.run_job(partial(page_data, engine.model, tokenizer, ask, settings.model_name))
        )
    except EngineStopped as e:
        raise APIError(503, str(e)) from None
    except Exception as e:
        line = f"{type(e).__name__}: {e}".splitlines()[0]
        raise APIError(500, f"the attention forward failed: {line}", code="engine_error") from None
    page = await asyncio.to_thread(viewer_html, data)  # JSON of up to ~1M weights: off the loop
    return HTMLResponse(page)


async def attention_ids(body: dict, tokenizer) -> tuple[list[int], str]:
    """The token ids /v1/attention runs, and the field they come from: `messages` rendered as
    `chat` renders them (so these are the ids the reply was generated after), then the reply's
    text encoded (the page keeps the reply as text); or a plain `prompt`."""
    if "messages" in body:
        if "prompt" in body:
            raise APIError(400, "give messages (with a reply) or a prompt, not both", "prompt")
        text = chat_prompt(tokenizer, wire.chat_messages(body), None)
        reply = wire.field_of(body, "reply", str, "", rule="text")
        return await encode(tokenizer, text) + await encode(tokenizer, reply), "messages"
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "give a prompt (text), or messages and a reply", "prompt")
    return await encode(tokenizer, prompt), "prompt"


def check_constraint_room(app, params: SamplingParams, prompts, field: str | None, chat: bool):
    """A 400 naming `field` (what set the constraint: response_format, a guided_* field, or
    tools for a forced call) when no text the constraint accepts fits in the tokens a prompt
    may have (max_tokens, or the server's default for it): constraints.check_room."""
    if params.constraint is None:
        return
    tokenizer, settings = app.state.tokenizer, app.state.settings
    for ids in prompts:
        n = wire.max_tokens_for(params, len(ids), settings, chat)
        try:
            check_room(params.constraint, tokenizer, n, "max_tokens")
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field) from None


ROUTES = {
    "GET": {
        "/health": health,
        "/v1/models": models,
        "/props": props,
        "/metrics": metrics,
        "/tokenizer_info": tokenizer_info,
    },
    "POST": {
        "/tokenize": tokenize,
        "/detokenize": detokenize,
        "/v1/completions": completions,
        "/v1/chat/completions": chat,
        "/v1/attention": attention,
    },
}


# --- reading --------------------------------------------------------------------------------------
async def read_body(request: Request) -> dict:
    """The request body as a JSON object; a 400 for one too large, malformed or not an object,
    a 415 for one declared as another media type (text/plain)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        message = f"the request body must be JSON (Content-Type: application/json), got {kind!r}"
        raise APIError(415, message, code="unsupported_media_type")
    declared = int(request.headers.get("content-length") or 0)
    chunks, seen = [], 0
    if declared <= wire.MAX_BODY_BYTES:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > wire.MAX_BODY_BYTES:
                break
            chunks.append(chunk)
    if max(declared, seen) > wire.MAX_BODY_BYTES:
        message = f"the request body is over {wire.MAX_BODY_BYTES} bytes: send a shorter prompt"
        raise APIError(400, message, "prompt", "context_length_exceeded")
    return wire.parse_body(b"".join(chunks))


async def prompt_ids(prompt: str | list, tokenizer, settings: Settings) -> list[int]:
    """A completion prompt (text or ids) as checked token ids."""
    ids = await encode(tokenizer, prompt) if isinstance(prompt, str) else prompt
    return wire.check_prompt_length(wire.token_ids(ids, settings, "prompt"), settings, "prompt")


async def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`; a long text is encoded off the event loop."""
    if len(text) < 4096:
        return tokenizer.encode(text)
    return await asyncio.to_thread(tokenizer.encode, text)


# --- running the choices --------------------------------------------------------------------------
def submit(
    app, rid: str, prompts, params: SamplingParams, n: int, echo: bool, chat: bool, adapter=0
):
    """One engine request per prompt and choice, through LoRA adapter `adapter` (0: the base).
    The n choices of a seeded request draw with seeds seed, seed + 1, ... (different from each
    other, each reproducible). Every request stops at <eos>, a chat reply also at the
    template's <|end|>, unless it asks ignore_eos."""
    engine, settings, tokenizer = app.state.engine, app.state.settings, app.state.tokenizer
    loop = asyncio.get_running_loop()
    names = ["<eos>", "<|end|>"] if chat else ["<eos>"]
    names = [] if params.ignore_eos else names
    stops = tuple(i for i in map(tokenizer.token_id, names) if i is not None)
    choices: list[Choice] = []
    wanted, room = len(prompts) * n, engine.max_queue
    if wanted > room:  # refused at every retry, even on an idle server: say so (not a 429)
        message = (
            f"this request needs {wanted} sequences ({len(prompts)} prompts x n={n}); this "
            f"server queues at most {room} (--max-queue), so it can never fit: send fewer"
        )
        raise APIError(400, message, "n" if n > 1 else "prompt")
    try:
        for i, (p, j) in enumerate(itertools.product(range(len(prompts)), range(n))):
            ids = prompts[p]
            choice_params = replace(
                params,
                max_tokens=wire.max_tokens_for(params, len(ids), settings, chat),
                seed=None if params.seed is None else params.seed + j,
                stop_token_ids=params.stop_token_ids + stops,
            )
            request = EngineRequest(f"{rid}-{i}", tuple(ids), choice_params, adapter)
            choice = Choice(i, request, tokenizer, engine.cancel, tuple(ids) if echo else ())

            def on_event(event, queue=choice.queue):  # on the engine's thread
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                    loop.call_soon_threadsafe(queue.put_nowait, event)

            engine.submit(request, on_event)
            choices.append(choice)
    except (QueueFull, EngineStopped, ValueError, APIError) as e:
        cancel_unfinished(app, choices)
        if isinstance(e, APIError):
            raise
        status = {QueueFull: 429, EngineStopped: 503}.get(type(e), 400)
        raise APIError(status, str(e)) from None
    return choices


async def wait_all(request: Request, app, choices: list[Choice]) -> bool:
    """Run every choice to its end; False (all cancelled) if the client goes away first."""

    async def drain(c: Choice):
        async for _ in c.events():
            pass

    task = asyncio.gather(*(drain(c) for c in choices))
    try:
        while not (await asyncio.wait({task}, timeout=POLL_S))[0]:
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return False
        task.result()
    finally:
        cancel_unfinished(app, choices)
    for c in choices:
        if c.finish_reason == "error":
            raise APIError(500, f"generation failed: {c.error}", code="engine_error")
        if c.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is stopping")
    return True


def cancel_unfinished(app, choices: list[Choice]) -> None:
    for c in choices:
        if c.finish_reason is None:
            app.state.engine.cancel(c.request.request_id)


def usage_of(choices: list[Choice], prompts: list[list[int]]) -> dict:
    return wire.usage(sum(map(len, prompts)), sum(len(c.tokens) for c in choices))


async def merged(choices: list[Choice]) -> AsyncIterator[Choice]:
    """Each choice after each of its events, in the order the events come. A choice takes its
    next event only once the caller is done with the last one: the caller sees each state of
    it (the finishing event once), never one a later event has already changed."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        async for _ in c.events():
            handled = asyncio.Event()
            await queue.put((c, handled))
            await handled.wait()
        await queue.put((None, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(choices)
        while running:
            c, handled = await queue.get()
            if c is None:
                running -= 1
            else:
                yield c
                handled.set()
    finally:
        for t in tasks:
            t.cancel()


def sse(chunks: AsyncIterator[dict], app, choices: list[Choice]) -> StreamingResponse:
    """Server-sent events, one `data: {json}` per chunk, then `data: [DONE]`. Whatever ends
    the response (a client gone even before the first chunk), unfinished choices are cancelled
    after it (`background` runs then)."""

    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        lines(),
        media_type="text/event-stream",
        headers=headers,
        background=BackgroundTask(cancel_unfinished, app, choices),
    )


def failure(c: Choice) -> dict | None:
    """The error chunk that ends a stream whose choice failed or was cancelled by a stop."""
    if c.finish_reason == "error":
        return APIError(500, f"generation failed: {c.error}", code="engine_error").body()
    if c.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is stopping").body()
    return None


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# --- completions ----------------------------------------------------------------------------------
async def stream_completion(app, rid, choices, body, k, echo) -> AsyncIterator[dict]:
    tokenizer = app.state.tokenizer
    model, _ = wire.requested_model(body, app.state.settings)

    def chunk(c: Choice, text: str, logprobs=None, finish=None) -> dict:
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return wire.envelope(rid, "text_completion", model, [choice])

    try:
        if echo and k is None:  # with logprobs, the echo waits for the prompt's log-probs
            for c in choices:
                yield chunk(c, tokenizer.decode(c.echo_ids))
        echoed: set[int] = set()
        async for c in merged(choices):
            if echo and k is not None and c.index not in echoed:
                echoed.add(c.index)
                prompt = wire.completion_logprobs(tokenizer, *wire.echo_logprobs(c))
                yield chunk(c, tokenizer.decode(c.echo_ids), prompt)
            if (error := failure(c)) is not None:
                yield error
                return
            new, logprobs = c.new_tokens(), None
            if k is not None and c.tokens[new]:
                logprobs = wire.completion_logprobs(
                    tokenizer, c.tokens[new], c.logprobs[new], c.top[new]
                )
            text = c.delta()
            if text or logprobs or c.finish_reason:
                yield chunk(c, text, logprobs, c.finish_reason)
        if include_usage(body):
            prompts = [c.request.prompt_ids for c in choices]
            yield wire.envelope(rid, "text_completion", model, [], usage_of(choices, prompts))
    finally:
        cancel_unfinished(app, choices)


# --- chat -----------------------------------------------------------------------------------------
async def stream_chat(app, rid, choices, body, want, tools=None) -> AsyncIterator[dict]:
    """A chat reply as chunks of text. With tools in "auto", the text streams as it comes
    but for what may still be a call (tools.CallSplitter), and each call goes out as one
    `delta.tool_calls` entry (index, id, name and all its arguments) once its block closes. A
    forced call (required, named) is one JSON object: it goes out whole at the end."""
    tokenizer = app.state.tokenizer
    model, _ = wire.requested_model(body, app.state.settings)
    auto = tools is not None and tools.mode == "auto"
    splitters = {c.index: CallSplitter(tools) for c in choices} if auto else {}

    def chunk(c: Choice, delta: dict, logprobs=None, finish=None) -> dict:
        choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return wire.envelope(rid, "chat.completion.chunk", model, [choice])

    try:
        for c in choices:
            yield chunk(c, {"role": "assistant", "content": ""})
        async for c in merged(choices):
            if (error := failure(c)) is not None:
                yield error
                return
            new, logprobs = c.new_tokens(), None
            if want and c.tokens[new]:
                logprobs = wire.chat_logprobs(tokenizer, c.tokens[new], c.logprobs[new], c.top[new])
            delta, finish = chat_delta(c, tools, splitters.get(c.index))
            if delta or logprobs or finish:
                yield chunk(c, delta, logprobs, finish)
        if include_usage(body):
            prompts = [c.request.prompt_ids for c in choices]
            yield wire.envelope(rid, "chat.completion.chunk", model, [], usage_of(choices, prompts))
    finally:
        cancel_unfinished(app, choices)


def chat_delta(
    c: Choice, tools: Tools | None, splitter: CallSplitter | None
) -> tuple[dict, str | None]:
    """The delta of a chat chunk and its finish_reason ("tool_calls" once a call was made):
    the new text; in "auto" (`splitter`), the content and calls it lets out; in a forced
    mode, nothing until the choice is finished, then its call (or its text, cut short)."""
    if tools is None or tools.mode == "none":
        text = c.delta()
        return ({"content": text} if text else {}), c.finish_reason
    if splitter is None:  # forced
        if c.finish_reason is None:
            return {}, None
        content, calls = parsed_reply(c.delta(), tools)
        made, first = calls, 0
    else:
        first = len(splitter.calls)
        content, calls = splitter.push(c.delta())
        if c.finish_reason is not None:
            content += splitter.finish()
        made = splitter.calls
    delta = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": first + i} | call for i, call in enumerate(calls)]
    finish = c.finish_reason and ("tool_calls" if made else c.finish_reason)
    return delta, finish


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


STREAM_GRACE = 0.5  # s after the engine stops for the streams it ended to send their last chunks


def run_server(app: FastAPI, sock: socket.socket, stop_timeout: float = 10.0) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM, then stop within about `stop_timeout` s:

    1. At the signal, every new request gets a 503 (Guard), also on a keep-alive connection
       and before uvicorn's next tick (it looks for the signal every 0.1 s).
    2. uvicorn stops accepting, and the engine stops at once (`engine.stop`): open requests
       finish for up to `stop_timeout` s, then the engine cancels the rest, so each open stream
       ends with its error chunk and [DONE], not cut at the connection.
    3. STREAM_GRACE s after the engine has stopped, the connections still open are dropped:
       nothing is left for them (a client still sending its body could only get a 503, one
       that reads no more would never get its last chunk), and uvicorn would wait for them
       until its own deadline, then cancel their handlers with a traceback each.
    """
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.stopping = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            app.state.stopping = True
            engine = asyncio.create_task(asyncio.to_thread(app.state.engine.stop, stop_timeout))
            closing = asyncio.create_task(super().shutdown(sockets))
            await engine
            await asyncio.wait({closing}, timeout=STREAM_GRACE)
            for connection in list(self.server_state.connections):
                connection.transport.abort()  # its handler sees a disconnect and ends
            await closing

    config = uvicorn.Config(
        app,
        log_level="warning",
        # a backstop only: shutdown() above drops what is left before it
        timeout_graceful_shutdown=stop_timeout + 4 * STREAM_GRACE,
        access_log=False,
    )
    if threading.current_thread() is not threading.main_thread():
        Server(config).run(sockets=[sock])
        return
    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown was
    # clean, so the re-raised signal is ignored and the process exits 0.
    signals = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        Server(config).run(sockets=[sock])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
