"""tools.py without a server: `CallSplitter`, fed a reply cut at every position, reads the
same content and calls as `parsed_reply` on the whole text, and both read what is written by
hand below; parallel_tool_calls is a boolean and false keeps one call."""

import json
import random

import pytest

from attnlab.serve import tools as T
from tests.serve.test_server_tools import TOOLS

WEATHER = '{"name": "weather", "arguments": {"city": "Oslo", "unit": "c", "days": 2}}'
PERSON = '{"name": "person", "arguments": {"name": "Ann"}}'
CALL_W = ("weather", '{"city": "Oslo", "unit": "c", "days": 2}')
CALL_P = ("person", '{"name": "Ann"}')


def block(inner: str) -> str:
    return f"<tool_call>{inner}</tool_call>"


# (reply, its content, its calls as (name, arguments)), read by hand from the rule.
REPLIES = [
    ("no call here", "no call here", []),
    ("trailing space stays without a call \n", "trailing space stays without a call \n", []),
    (f"Let me look.{block(WEATHER)}", "Let me look.", [CALL_W]),
    (f"I'll check.\n{block(WEATHER)}\n{block(PERSON)}\n", "I'll check.", [CALL_W, CALL_P]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [CALL_W]),
    (f"Hi there {block(WEATHER)} bye", "Hi there bye", [CALL_W]),
    (f"x {block('not json')} y {block(PERSON)}", f"x {block('not json')} y", [CALL_P]),
    (block('{"name": "rm", "arguments": {}}'), block('{"name": "rm", "arguments": {}}'), []),
    (f"a {block(PERSON)} b {block('[1]')}", f"a b {block('[1]')}", [CALL_P]),
    (f"hi {block(PERSON)} <tool_call>{WEATHER[:19]}", f"hi <tool_call>{WEATHER[:19]}", [CALL_P]),
    (f"<{block(WEATHER)}", "<", [CALL_W]),
    (f"a <tool_ x </tool_call> {block(PERSON)} <tool", "a <tool_ x </tool_call> <tool", [CALL_P]),
    (f"<tool_call>abc {block(WEATHER)} tail", f"<tool_call>abc {block(WEATHER)} tail", []),
    (f"héllo ✓ {block(PERSON)}\n\n  ", "héllo ✓", [CALL_P]),
    (f"{block(WEATHER)}{block(PERSON)}", None, [CALL_W, CALL_P]),
]


def named(calls: list[dict]) -> list[tuple[str, str]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def split(pieces: list[str], tools: T.Tools) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream of `pieces` gives, put together."""
    splitter, content, calls = T.CallSplitter(tools), "", []
    for piece in pieces:
        text, new = splitter.push(piece)
        content, calls = content + text, calls + new
    assert calls == splitter.calls
    return content + splitter.finish(), named(calls)


def whole(text: str, tools: T.Tools) -> tuple[str, list[tuple[str, str]]]:
    content, calls = T.parsed_reply(text, tools)
    return content or "", named(calls)


def tools_of(**body) -> T.Tools:
    return T.requested_tools({"tools": TOOLS} | body)


@pytest.mark.parametrize("text, content, calls", REPLIES)
def test_parsed_reply_reads_calls_and_leaves_blocks_that_do_not_parse(text, content, calls):
    got_content, got_calls = T.parsed_reply(text, tools_of())
    assert (got_content, named(got_calls)) == (content, calls)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("text", [r[0] for r in REPLIES])
def test_a_reply_cut_anywhere_splits_as_the_whole_text(text, parallel):
    tools = tools_of(parallel_tool_calls=parallel)
    expected = whole(text, tools)
    for i in range(len(text) + 1):
        assert split([text[:i], text[i:]], tools) == expected, i
    assert split(list(text), tools) == expected  # one character at a time
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert split(pieces, tools) == expected, pieces


def test_the_splitter_lets_text_out_early_and_each_call_at_its_closing_tag():
    splitter = T.CallSplitter(tools_of())
    steps = [
        ("Hi there", "Hi there", []),
        (" <tool_", "", []),  # could begin a call: held, with the space before it
        ("call>" + WEATHER[:30], "", []),
        (WEATHER[30:] + "</tool", "", []),
        ("_call>", "", [CALL_W]),  # the block closed: the call goes out now
        (" bye <tool_call>[1]", " bye", []),
        ("</tool_call>", " <tool_call>[1]</tool_call>", []),  # not a call: its text
    ]
    for piece, content, calls in steps:
        text, new = splitter.push(piece)
        assert (text, named(new)) == (content, calls), piece
    assert splitter.finish() == ""


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"{block('oops')} {block(PERSON)} and {block(WEATHER)} done"
    tools = tools_of(parallel_tool_calls=False)
    assert (
        not tools.parallel and tools_of().parallel and tools_of(parallel_tool_calls=None).parallel
    )
    content, calls = T.parsed_reply(text, tools)
    assert (content, named(calls)) == (f"{block('oops')} and done", [CALL_P])
    assert named(T.parsed_reply(text, tools_of())[1]) == [CALL_P, CALL_W]
    forced = tools_of(tool_choice="required", parallel_tool_calls=False)
    assert len(T.parsed_reply(WEATHER, forced)[1]) == 1


@pytest.mark.parametrize("value", ["false", 0, 1, [], {}])
def test_parallel_tool_calls_must_be_a_boolean(value):
    with pytest.raises(T.ToolError) as err:
        tools_of(parallel_tool_calls=value)
    assert err.value.param == "parallel_tool_calls" and repr(value) in str(err.value)


def test_arguments_are_written_back_as_json_text():
    ((_, arguments),) = named(T.parsed_reply(block(WEATHER), tools_of())[1])
    assert json.loads(arguments) == json.loads(WEATHER)["arguments"]
