"""OpenAI's wire format, as plain functions: reading a request body into checked values and
writing the response objects. No HTTP and no engine here (app.py does both).

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so the `openai`
client raises its typed exceptions: 400 bad input, 401 a wrong or missing API key, 404 an
unknown route, 429 the engine's queue is full, 503 the server is stopping.
"""

import json
import math
import time
from dataclasses import dataclass, field

from attnlab.inference.constraints import Constraint
from attnlab.inference.sampling import CHAT_SAMPLING, MAX_PENALTY, SamplingConfig, bias_pairs
from attnlab.serve.choice import Choice
from attnlab.serve.tools import parsed_reply
from attnlab.serve.types import SamplingParams

MAX_BODY_BYTES = 4 * 2**20  # a request body beyond this is refused before it is parsed
MAX_N = 16  # choices per prompt
MAX_STOP = 4  # stop strings, as OpenAI
MAX_LOGPROBS = 20  # alternatives per token
DEFAULT_MAX_TOKENS = 16  # a completion's default (OpenAI's); a chat reply may fill the context


class APIError(Exception):
    """An error answered in OpenAI's shape (see `body`)."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        415: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Settings:
    """What the server knows beside the engine.

    Attributes:
        model_name: the model id clients send for the base (an unknown one is a 404).
        context: prompt + generated tokens of one request, at most.
        vocab_size: token ids must be below it.
        api_key: when set, /v1 and the tokenizer endpoints need `Authorization: Bearer KEY`.
        stop_timeout: seconds running requests get when the server stops.
        adapters: {model id: adapter directory} of the LoRA adapters served beside the base
            (`--lora NAME=DIR`); the i-th named is the engine's adapter i + 1 (0: the base).
        ui: serve the chat page (static/chat.html) at `/` (`--no-ui`: off).
        chat_sampling: the sampler of a chat completion's fields that the request leaves out
            (inference.sampling.chat_sampling: the checkpoint's own defaults, else
            llama.cpp's); a completion's are OpenAI's (SamplingConfig's: temperature 1).
    """

    model_name: str
    context: int
    vocab_size: int
    api_key: str | None = None
    stop_timeout: float = 10.0
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: dict[str, str] = field(default_factory=dict)
    ui: bool = True
    chat_sampling: SamplingConfig = CHAT_SAMPLING


# --- reading a request ----------------------------------------------------------------------------
def parse_body(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # json.loads recurses once per level of nesting
        raise APIError(400, "the request body is nested too deeply to read as JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def field_of(body: dict, name: str, kind: type, default, check=None, rule: str = ""):
    """body[name] (`default` when absent or null), of type `kind` and passing `check`; a 400
    naming the field and `rule` otherwise. An int is accepted for a float; a bool never for
    a number."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok or (check is not None and not check(value)):
        raise APIError(400, f"{name} must be {rule or kind.__name__}, got {value!r}", name)
    return value


def requested_model(body: dict, settings: Settings) -> tuple[str, int]:
    """(model id, adapter index) of the model a request names: the base (index 0; also when
    it names none) or one of the LoRA adapters, as vLLM picks them. Any other name is a 404,
    as OpenAI and vLLM answer."""
    model = body.get("model", settings.model_name)
    if model == settings.model_name:
        return model, 0
    names = list(settings.adapters)
    if isinstance(model, str) and model in names:
        return model, names.index(model) + 1
    served = ", ".join(repr(n) for n in [settings.model_name, *names])
    message = f"model {model!r} is not served here: use one of {served}"
    raise APIError(404, message, "model", "model_not_found")


def token_ids(value, settings: Settings, param: str) -> list[int]:
    """A list of token ids, each inside the vocabulary."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise APIError(400, f"{param} must be a list of token ids", param)
    bad = [t for t in value if not 0 <= t < settings.vocab_size]
    if bad:
        message = f"token id {bad[0]} is outside the vocabulary [0, {settings.vocab_size})"
        raise APIError(400, message, param)
    return value


def check_prompt_length(ids: list[int], settings: Settings, param: str) -> list[int]:
    """A prompt must be non-empty and leave room for at least one new token."""
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token", param)
    if len(ids) >= settings.context:
        message = (
            f"the prompt has {len(ids)} tokens; this model's context is {settings.context}: "
            "shorten it"
        )
        raise APIError(400, message, param, "context_length_exceeded")
    return ids


def raw_prompts(body: dict) -> list[str | list[int]]:
    """A completion's prompts: a string, a list of ids, or a list of either (not yet encoded)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt is required (text or token ids)", "prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be text, token ids, or a non-empty list of them", "prompt")
    for p in prompt:
        if not isinstance(p, (str, list)):
            raise APIError(400, f"each prompt must be text or token ids, got {p!r}", "prompt")
    return prompt


def chat_messages(body: dict) -> list[dict]:
    """The messages of a chat request, with text content (OpenAI's list of parts joined).
    An assistant message may carry `tool_calls` instead of content (their arguments, JSON
    text on the wire, become objects, as templates read them and vLLM passes them); a
    `role: "tool"` message needs the `tool_call_id` it answers."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must have a role and content", "messages")
        calls = tool_calls_of(m, i) if m["role"] == "assistant" else []
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be text", "messages")
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = calls
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                text = f"messages[{i}] (role tool) needs the tool_call_id it answers"
                raise APIError(400, text, "messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def tool_calls_of(message: dict, i: int) -> list[dict]:
    """An assistant message's earlier tool calls, each {"id", "type": "function", "function":
    {"name", "arguments"}}, with the arguments read from JSON text where they are some."""
    calls = message.get("tool_calls") or []
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            text = f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}"
            raise APIError(400, text, "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # left as the text the client sent
        function = {"name": function["name"], "arguments": arguments}
        out.append({"id": call.get("id"), "type": "function", "function": function})
    return out


def choices_per_prompt(body: dict) -> int:
    return field_of(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}]")


def streamed(body: dict) -> bool:
    return field_of(body, "stream", bool, False, rule="a boolean")


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    return tuple(stop)


def logit_bias(body: dict, settings: Settings) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (id, bias) pairs; every id
    inside the vocabulary."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        message = f"logit_bias must be an object of token id -> bias, got {value!r}"
        raise APIError(400, message, "logit_bias")
    try:
        pairs = bias_pairs(value)
    except ValueError as e:
        raise APIError(400, str(e), "logit_bias") from None
    bad = [t for t, _ in pairs if t >= settings.vocab_size]
    if bad:
        message = f"logit_bias key {bad[0]} is outside the vocabulary [0, {settings.vocab_size})"
        raise APIError(400, message, "logit_bias")
    return pairs


def sampler_fields(body: dict, settings: Settings, default: SamplingConfig) -> dict:
    """The sampler's parameters (OpenAI's and vLLM's names and ranges), each a 400 naming it
    when out of range; a field left out takes `default`'s value."""
    penalty = f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"

    def in_range(v: float) -> bool:
        return -MAX_PENALTY <= v <= MAX_PENALTY

    d = default
    return dict(
        temperature=field_of(
            body, "temperature", float, d.temperature, lambda v: 0 <= v <= 2, "in [0, 2]"
        ),
        top_p=field_of(body, "top_p", float, d.top_p or 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=field_of(
            body, "top_k", int, d.top_k or -1, lambda v: v >= -1, "-1 or 0 (off), or >= 1"
        ),
        min_p=field_of(body, "min_p", float, d.min_p or 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        presence_penalty=field_of(
            body, "presence_penalty", float, d.presence_penalty, in_range, penalty
        ),
        frequency_penalty=field_of(
            body, "frequency_penalty", float, d.frequency_penalty, in_range, penalty
        ),
        repetition_penalty=field_of(
            body,
            "repetition_penalty",
            float,
            d.repetition_penalty,
            lambda v: 0 < v < math.inf,
            "a number > 0",
        ),
        logit_bias=logit_bias(body, settings),
        min_tokens=field_of(body, "min_tokens", int, 0, lambda v: v >= 0, "an integer >= 0"),
        ignore_eos=field_of(body, "ignore_eos", bool, False, rule="a boolean"),
        constraint=constraint(body),
    )


GUIDED = ("guided_json", "guided_regex", "guided_choice")  # vLLM's extra fields


def constraint_field(body: dict) -> str | None:
    """The field that constrains the output (response_format or a guided_* one), None when
    none does; a 400 when two are given."""
    given = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"give one of {given} (each constrains the whole output)", given[1])
    return given[0] if given else None


def constraint(body: dict) -> Constraint | None:
    """What the output must be: OpenAI's response_format ({"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"schema": ...}}) or one of vLLM's guided_json /
    guided_regex / guided_choice; a 400 naming the field when it is malformed or does not
    compile, or when two are given."""
    name = constraint_field(body)
    if name is None:
        return None
    value = body[name]
    try:
        if name == "guided_json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {value!r}")
            return Constraint.json_schema(schema)
        if name == "guided_regex":
            if not isinstance(value, str):
                raise ValueError(f"a regular expression is a string, got {value!r}")
            return Constraint.regex(value)
        if name == "guided_choice":
            if not isinstance(value, list):
                raise ValueError(f"the choices are a list of strings, got {value!r}")
            return Constraint.choice(value)
        return response_format(value)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{name}: {e}", name) from None


def response_format(value) -> Constraint | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON schema (an object)")
        return Constraint.json_schema(schema)
    raise ValueError(f'type must be "text", "json_object" or "json_schema", got {value!r}')


def sampling_params(
    body: dict, settings: Settings, *, logprobs: int | None, prompt_logprobs: bool, chat: bool
) -> SamplingParams:
    """SamplingParams from the request; max_tokens is -1 where the request leaves it to the
    server (resolved per prompt by `max_tokens_for`)."""
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    limit = settings.context - 1
    low = 0 if prompt_logprobs else 1  # 0: score the prompt only (echo + logprobs)
    rule = f"in [{low}, {limit}] (the context is {settings.context} tokens)"
    max_tokens = field_of(body, name, int, -1, lambda v: low <= v <= limit, rule)
    stop_ids = token_ids(body.get("stop_token_ids") or [], settings, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        stop=stop_strings(body),
        stop_token_ids=tuple(stop_ids),
        seed=field_of(body, "seed", int, None, rule="an integer"),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        **sampler_fields(body, settings, settings.chat_sampling if chat else SamplingConfig()),
    )


def max_tokens_for(params: SamplingParams, n_prompt: int, settings: Settings, chat: bool) -> int:
    """The request's max_tokens, or its default: 16 for a completion (less where the context
    has less room), the rest of the context for a chat reply; a 400 where it does not fit."""
    room = settings.context - n_prompt
    if params.max_tokens > room:
        message = (
            f"the prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"this model's context of {settings.context} tokens"
        )
        raise APIError(400, message, "max_tokens", "context_length_exceeded")
    n = params.max_tokens if params.max_tokens >= 0 else room if chat else DEFAULT_MAX_TOKENS
    n = min(n, room)
    if params.min_tokens > n:
        message = f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({n})"
        raise APIError(400, message, "min_tokens")
    return n


# --- writing a response ---------------------------------------------------------------------------
def token_text(tokenizer, token_id: int) -> str:
    """A token's text; a piece of a multi-byte character (no text alone) is named by the
    vocabulary's own string for it, so distinct tokens keep distinct keys in top_logprobs."""
    text = tokenizer.decode([token_id], skip_special=False)
    if "\ufffd" in text:
        return tokenizer.backend.id_to_token(token_id) or text
    return text


def completion_logprobs(tokenizer, tokens, logprobs, tops) -> dict:
    """The legacy completions `logprobs` object: each token's text, its log-prob, the top
    alternatives ({text: log-prob}) and its character offset."""
    strings = [token_text(tokenizer, t) for t in tokens]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    top = [None if d is None else {token_text(tokenizer, i): v for i, v in d.items()} for d in tops]
    return {
        "tokens": strings,
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, tokens, logprobs, tops) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def entry(t: int, lp: float) -> dict:
        s = token_text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = [
        entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in (top or {}).items()]}
        for t, lp, top in zip(tokens, logprobs, tops)
    ]
    return {"content": content}


def envelope(rid: str, kind: str, model: str, choices: list, usage=None) -> dict:
    """The object around the choices ("text_completion", "chat.completion", or a chunk) of a
    request for `model` (the base's id or an adapter's)."""
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def echo_logprobs(c: Choice) -> tuple[list[int], list, list]:
    """The prompt's part of an echo: each token's log p given those before it (None for the
    first), and its top_logprobs: the model's most likely tokens there and the prompt token
    (as vLLM: lm-eval's is_greedy compares the token with the best of these)."""
    ids = list(c.echo_ids)
    lps = list(c.prompt_logprobs or [None] * len(ids))
    tops = list(c.prompt_top or [None if lp is None else {t: lp} for t, lp in zip(ids, lps)])
    if len(lps) == len(ids) - 1:
        lps, tops = [None, *lps], [None, *tops]
    return ids, lps, tops


def completion_choice(tokenizer, c: Choice, k: int | None) -> dict:
    logprobs, text = None, c.text
    if k is not None:
        tokens, lps, tops = list(c.tokens), list(c.logprobs), list(c.top)
        if c.echo_ids:
            ids, plps, ptops = echo_logprobs(c)
            tokens, lps, tops = ids + tokens, plps + lps, ptops + tops
        logprobs = completion_logprobs(tokenizer, tokens, lps, tops)
    if c.echo_ids:
        text = tokenizer.decode(c.echo_ids) + text
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def chat_choice(tokenizer, c: Choice, want: bool, tools=None) -> dict:
    """A chat choice; with tools, the calls read from the reply (tools.py) are its
    `tool_calls` and its finish_reason is "tool_calls"."""
    logprobs = chat_logprobs(tokenizer, c.tokens, c.logprobs, c.top) if want else None
    content, calls = parsed_reply(c.text, tools)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "index": c.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": "tool_calls" if calls else c.finish_reason,
    }


def props(settings: Settings) -> dict:
    """llama.cpp's /props, the part a chat client reads: the sampler a chat reply takes where
    the request leaves a field out (None: that processor is off), the context, the model."""
    d = settings.chat_sampling
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    names += ("presence_penalty", "frequency_penalty")
    defaults = {name: getattr(d, name) for name in names}
    return {
        "model": settings.model_name,
        "n_ctx": settings.context,
        "default_generation_settings": defaults,
    }


def prometheus_text(stats: dict[str, float], http: dict[int, int]) -> str:
    """Prometheus' text format: the engine's stats (names ending in _total are counters, but
    kv_blocks_total, a pool size; time_to_first_token_seconds a summary; the rest gauges) and
    the HTTP responses by status code."""
    lines = [
        "# HELP attnlab_http_responses_total HTTP responses by status code.",
        "# TYPE attnlab_http_responses_total counter",
    ]
    lines += [f'attnlab_http_responses_total{{code="{k}"}} {v}' for k, v in sorted(http.items())]
    summaries = {k.rsplit("_", 1)[0] for k in stats if k.endswith(("_sum", "_count"))}
    for name in sorted(summaries):
        lines.append(f"# TYPE attnlab_{name} summary")
        lines += [f"attnlab_{name}_{p} {stats.get(f'{name}_{p}', 0)}" for p in ("sum", "count")]
    for key, value in sorted(stats.items()):
        if key.rsplit("_", 1)[0] in summaries:
            continue
        counter = key.endswith("_total") and not key.startswith("kv_blocks")
        lines += [
            f"# TYPE attnlab_{key} {'counter' if counter else 'gauge'}",
            f"attnlab_{key} {value}",
        ]
    return "\n".join(lines) + "\n"
