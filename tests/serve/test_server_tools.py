"""Tool calls through the real server and the official `openai` client: tool_choice required
and named are constrained to a call whose arguments validate against the function's schema
(`jsonschema`), for an untrained tiny model over many seeds, plain and streamed; tool results
come back as `role: "tool"` messages; bad tools are OpenAI-shaped 400s naming the field. The
unit tests below check the pieces (tools.py) without a server."""

import json
from dataclasses import replace

import openai
import pytest
import torch

from attnlab.checkpoint import save_pretrained
from attnlab.models.build import build_model
from attnlab.models.presets import llama_tiny
from attnlab.serve import tools as T
from attnlab.tokenizer import CHAT_TOKENS, train_bpe_tokenizer
from tests.inference.test_constraints import SCHEMA
from tests.serve.server_helpers import TEXT, Server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "person", "parameters": SCHEMA}},
]
SCHEMAS = {"weather": WEATHER, "person": SCHEMA}
ASK = [{"role": "user", "content": "the weather in Paris?"}]
N, SEEDS = 10, tuple(range(0, 1000, 100))  # 100 replies per tool_choice (choice j: seed + j)


# --- the pieces, without a server -----------------------------------------------------------------
def tools_of(**body) -> T.Tools | None:
    return T.requested_tools({"tools": TOOLS} | body)


def test_tool_choice_modes():
    assert tools_of().mode == "auto"
    assert tools_of(tool_choice="required").forced
    named = tools_of(tool_choice={"type": "function", "function": {"name": "person"}})
    assert (named.mode, named.name, named.forced) == ("named", "person", True)
    assert T.requested_tools({}) is None and T.requested_tools({"tool_choice": "none"}) is None


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": {"weather": {}}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ]
            },
            "tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(T.ToolError) as err:
        T.requested_tools(body)
    assert err.value.param == param


def test_auto_reads_tool_call_tags_and_keeps_the_rest_as_content():
    tools = tools_of()
    text = 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = T.parsed_reply(text, tools)
    assert content == "Let me look."
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert T.parsed_reply("no call here", tools) == ("no call here", [])
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert T.parsed_reply(unknown, tools) == (unknown, [])  # not a tool: left as text
    assert T.parsed_reply(text, tools_of(tool_choice="none")) == (text, [])


def test_fallback_lists_the_tools_and_writes_the_history_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = T.fallback_messages(history, tools_of())
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert (
        out[0]["content"].startswith("Be brief.\n\n") and json.dumps(TOOLS[1]) in out[0]["content"]
    )
    assert (
        out[2]["content"]
        == '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


# --- through the server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """server_helpers' tiny model with room for the tools' listing (~900 tokens of this
    small vocabulary) in its context."""
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer([TEXT], 320, CHAT_TOKENS)
    config = replace(llama_tiny(), vocab_size=tokenizer.vocab_size, max_seq_len=2048)
    path = tmp_path_factory.mktemp("serve") / "tiny"
    server = Server(save_pretrained(path, build_model(config).eval(), config, tokenizer))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_call(call, names) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", "weather"])
def test_forced_calls_always_parse_and_validate(client, choice):
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    names = set(SCHEMAS) if choice == "required" else {choice}
    seen = set()
    for seed in SEEDS:
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=200, n=N, seed=seed, temperature=1.5,
        )  # fmt: skip  (200: the longest call, one byte a token and \uXXXX escapes, fits)
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert len(c.message.tool_calls) == 1
            check_call(c.message.tool_calls[0], names)
            seen.add(c.message.tool_calls[0].function.name)
    assert seen == names


@pytest.mark.slow
def test_a_streamed_call_is_the_plain_one(client):
    fields = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, seed=3
    )
    plain = client.chat.completions.create(**fields).choices[0].message.tool_calls[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for delta_call in chunk.choices[0].delta.tool_calls or ():
            calls.setdefault(delta_call.index, []).append(delta_call)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    (streamed,) = calls[0]  # the whole call in one delta
    assert (streamed.function.name, streamed.function.arguments) == (
        plain.function.name,
        plain.function.arguments,
    )
    check_call(streamed, set(SCHEMAS))


@pytest.mark.slow
def test_a_tool_result_turn_is_accepted_and_rendered(client, server):
    first = (
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "weather"}},
            max_tokens=80,
            seed=1,
        )
        .choices[0]
        .message
    )
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in first.tool_calls],
        },
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].message.role == "assistant"
    tools = T.requested_tools({"tools": TOOLS})
    messages = [{"role": "user", "content": ASK[0]["content"]}]
    call = {
        "function": {
            "name": "weather",
            "arguments": json.loads(first.tool_calls[0].function.arguments),
        }
    }
    messages += [{"role": "assistant", "content": "", "tool_calls": [call]}]
    messages += [{"role": "tool", "content": "sunny, 21 C", "tool_call_id": "x"}]
    text = server.tokenizer.apply_chat_template(T.fallback_messages(messages, tools))
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert out.usage.prompt_tokens == len(server.tokenizer.encode(text))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ]
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, fields, param):
    fields = {"messages": ASK} | fields
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=4, **fields)
    assert err.value.body["param"] == param, err.value.body


def test_a_template_that_reads_tools_gets_them_and_others_get_the_fallback():
    from attnlab.serve.app import chat_prompt
    from attnlab.tokenizer import Tokenizer
    from tests.test_tokenizer_chat import TOOLS_TEMPLATE

    plain = train_bpe_tokenizer([TEXT], 320, CHAT_TOKENS)
    reads = Tokenizer(plain.backend, TOOLS_TEMPLATE)
    tools = T.requested_tools({"tools": TOOLS})
    assert chat_prompt(reads, ASK, tools) == reads.apply_chat_template(ASK, tools=TOOLS)
    fallback = chat_prompt(plain, ASK, tools)
    assert fallback == plain.apply_chat_template(T.fallback_messages(ASK, tools))
    assert fallback.startswith("<|system|>\nYou may call these functions.")


@pytest.mark.slow
def test_auto_reads_a_call_the_model_wrote(client):
    """An untrained model writes no <tool_call> by itself: guided_choice makes it write one."""
    wrote = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    fields = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80)
    fields |= dict(extra_body={"guided_choice": [wrote]})
    out = client.chat.completions.create(**fields).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    assert json.loads(out.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    chunks = list(client.chat.completions.create(stream=True, **fields))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    (call,) = [t for d in deltas for t in d.tool_calls or ()]
    assert call.function.name == "weather" and chunks[-1].choices[0].finish_reason == "tool_calls"


# --- tool_choice "auto", streamed token by token ---------------------------------------------
def escaped(literal: str) -> str:
    """`literal` as a regular expression (llguidance reads Rust's syntax)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$" else ch for ch in literal)


PIECES = [  # what guided_regex lets the untrained model write, in any order, 1 to 6 of them
    escaped("Sure. "),
    "\n",
    escaped('<tool_call>{"name": "weather", "arguments": {"city": "')
    + "(Oslo|Rome)"
    + escaped('", "unit": "c", "days": ')
    + "[1-7]"
    + escaped("}}</tool_call>"),
    escaped('<tool_call>{"name":"person","arguments":{}}</tool_call>'),
    escaped('<tool_call>{"name": "rm"}</tool_call>'),  # no such tool: text
    escaped("<tool_call>{oops</tool_call>"),  # not JSON: text
]
MIXED = "(" + "|".join(PIECES) + "){1,6}"


def streamed_reply(client, **fields) -> tuple[str, list, str, list[str]]:
    """(content, tool calls, finish_reason, what came in order) of a stream, put together as
    OpenAI's function-calling guide does: the calls by their index, arguments appended."""
    content, calls, finish, order = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **fields):
        delta = chunk.choices[0].delta
        if delta.content:
            content += delta.content
            order.append("content")
        for call in delta.tool_calls or ():
            if call.index not in calls:
                calls[call.index] = call
            else:
                calls[call.index].function.arguments += call.function.arguments or ""
            order.append("call")
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish, order


def written(calls) -> list[tuple[str, str]]:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
    return [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.slow
def test_auto_streams_the_reply_the_plain_request_gets(client):
    """Same seed, same tokens: the stream's content and calls are the plain reply's, with
    parallel_tool_calls true and false (the first call of the parallel reply, or none)."""
    seen = {"several calls": 0, "a block left as text": 0, "text after a streamed call": 0}
    for seed in range(12):
        fields = dict(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, seed=seed, temperature=1.5
        )
        fields["extra_body"] = {"guided_regex": MIXED}
        every = None
        for parallel in (True, False):
            plain = client.chat.completions.create(parallel_tool_calls=parallel, **fields)
            plain = plain.choices[0]
            content, calls, finish, order = streamed_reply(
                client, parallel_tool_calls=parallel, **fields
            )
            assert content == (plain.message.content or "")
            assert written(calls) == written(plain.message.tool_calls or [])
            assert finish == plain.finish_reason
            assert (finish == "tool_calls") == bool(calls)
            if parallel:
                every = written(calls)
                seen["several calls"] += len(calls) > 1
                seen["a block left as text"] += "<tool_call>" in content
                seen["text after a streamed call"] += (
                    "content" in order[order.index("call") :] if calls else 0
                )
            else:
                assert written(calls) == every[:1]
    assert all(seen.values()), seen


@pytest.mark.slow
def test_parallel_tool_calls_must_be_a_boolean(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=4,
            extra_body={"parallel_tool_calls": "no"},
        )  # fmt: skip
    assert err.value.body["param"] == "parallel_tool_calls", err.value.body


@pytest.mark.slow
def test_a_forced_call_max_tokens_cannot_finish_is_a_400_naming_tools(client):
    """The call {"name":"long","arguments":{"s":"<2000 characters>"}} needs more than 16
    tokens of this vocabulary."""
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2000}}}
    tools = [
        {"type": "function", "function": {"name": "long", "parameters": long | {"required": ["s"]}}}
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=tools, tool_choice="required", max_tokens=16
        )
    assert err.value.body["param"] == "tools" and "max_tokens=16" in err.value.body["message"]
