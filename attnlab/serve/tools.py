"""Tool calls in chat completions (OpenAI's function calling): reading `tools` and
`tool_choice`, showing the tools to the model, and reading the calls back out of its reply.

    tools + tool_choice ─check─> Tools ─(required / named)─> one JSON schema ─> Constraint
    messages (+ tool results) ─chat template (tools=...)─> prompt ─> reply ─parse─> tool_calls

How the model is told about the tools: a chat template that reads `tools` (Qwen's, Hermes',
Llama 3's) gets them as `transformers` passes them, the client's list unchanged. A template that
does not (attnlab's own) gets the fallback many servers use: a system message listing the tools
as JSON and asking for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier
calls in the history are written that way too, and tool results as user turns inside
`<tool_response>...</tool_response>`.

How a call is read back:
- tool_choice "required" or a named function: the reply is constrained (constraints.py) to
  the JSON object {"name": <a tool's name>, "arguments": <valid for that tool's parameters>}
  (one schema, anyOf over the tools), so it always parses; cut by max_tokens it is returned as
  text with finish_reason "length".
- "auto": every `<tool_call>{json}</tool_call>` block of the free reply whose JSON names a
  tool (Qwen's and Hermes' format) is a call; a block that does not parse as one stays text,
  and the text around the calls is the content (see `parsed_reply` for the whitespace).
  Streamed, `CallSplitter` reads the same calls and content as the text comes.
- "none": the tools are shown but no call is read.

parallel_tool_calls (OpenAI's field, default true): false allows at most one call. In "auto"
that is the first block that parses; later blocks that parse are dropped, neither calls nor
content, as vLLM filters them (OpenAI promises at most one call and says nothing of the rest).
The forced modes make exactly one call either way.
"""

import json
import re
import uuid
from dataclasses import dataclass

from attnlab.inference.constraints import Constraint

MODES = ("none", "auto", "required")
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL = re.compile(rf"{OPEN}\s*(.*?)\s*{CLOSE}", re.S)  # the first CLOSE ends a block
ANY_OBJECT = {"type": "object"}


class ToolError(ValueError):
    """Bad tools or tool_choice; `param` names the field (the server answers a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools. specs: the tools as the client sent them (what a template reads);
    schemas: {name: parameters JSON schema}; mode: "none", "auto", "required" or "named";
    name: the function tool_choice names (mode "named"); parallel: more than one call may be
    made (parallel_tool_calls)."""

    specs: tuple[dict, ...]
    schemas: dict[str, dict]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The reply must be a call (required, or a named function)."""
        return self.mode in ("required", "named")


def requested_tools(body: dict) -> Tools | None:
    """The request's tools and tool_choice, checked; None when it gives no tools (and
    tool_choice is absent or "none"). A ToolError names the field that is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        message = f"parallel_tool_calls must be a boolean, got {parallel!r}"
        raise ToolError(message, "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError(
                f"tool_choice {choice!r} needs tools: give the functions", "tool_choice"
            )
        return None
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a list of function tools, got {tools!r}", "tools")
    schemas = {}
    for i, tool in enumerate(tools):
        name, schema = function_of(tool, i)
        if name in schemas:
            raise ToolError(f"tools[{i}]: the name {name!r} is given twice", "tools")
        schemas[name] = schema
    mode, name = tool_mode(choice, schemas)
    return Tools(tuple(tools), schemas, mode, name, parallel is not False)


def function_of(tool, i: int) -> tuple[str, dict]:
    """(name, parameters schema) of tools[i], {"type": "function", "function": {"name",
    "description", "parameters"}}; the schema must compile (constraints.py)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(function, dict)
    ):
        message = f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}'
        raise ToolError(f"{message}, got {tool!r}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        message = f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}"
        raise ToolError(message, "tools")
    if not isinstance(function.get("description", ""), str):
        raise ToolError(f"tools[{i}].function.description must be text", "tools")
    schema = function.get("parameters", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    try:
        Constraint.json_schema(schema)
    except ValueError as e:
        raise ToolError(f"tools[{i}].function.parameters: {e}", "tools") from None
    return name, schema


def tool_mode(choice, schemas: dict[str, dict]) -> tuple[str, str | None]:
    """(mode, name) of tool_choice: "auto" when absent; {"type": "function", "function":
    {"name": N}} is ("named", N) for a function among the tools."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in MODES:
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        message = f'tool_choice must be one of {MODES} or {{"type": "function", "function": '
        raise ToolError(f'{message}{{"name": ...}}}}, got {choice!r}', "tool_choice")
    if name not in schemas:
        message = f"tool_choice names {name!r}, which is not among the tools: {list(schemas)}"
        raise ToolError(message, "tool_choice")
    return "named", name


def call_constraint(tools: Tools) -> Constraint:
    """What a forced reply must be: {"name": N, "arguments": <valid for N's parameters>} for
    N the named function, or any of the tools (anyOf)."""
    names = [tools.name] if tools.mode == "named" else list(tools.schemas)
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": tools.schemas[n]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    return Constraint.json_schema(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})


# --- showing the tools to a template that does not read them ------------------------------------
def fallback_messages(messages: list[dict], tools: Tools) -> list[dict]:
    """The conversation for a template without `tools`: a system message with the tools
    first (joined to the client's own system message), earlier calls as <tool_call> text,
    tool results as user turns."""
    listed = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in tools.specs)
    block = (
        "You may call these functions. To call one, reply with "
        '<tool_call>{"name": <function name>, "arguments": <its arguments>}</tool_call>\n'
        f"<tools>\n{listed}\n</tools>"
    )
    out = [{"role": m["role"], "content": written(m)} for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return [m | {"role": "user"} if m["role"] == "tool" else m for m in out]


def written(message: dict) -> str:
    """A message's text in the fallback format."""
    if message["role"] == "tool":
        return f"<tool_response>\n{message['content']}\n</tool_response>"
    calls = [
        json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        for c in message.get("tool_calls") or ()
    ]
    return "".join([message["content"], *(f"<tool_call>{c}</tool_call>" for c in calls)])


# --- reading the calls back -----------------------------------------------------------------------
def parsed_reply(text: str, tools: Tools | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole reply: the calls in OpenAI's shape ({"id", "type":
    "function", "function": {"name", "arguments": JSON text}}), and the text left (None when
    only calls were written). Without calls: (text, []).

    In "auto", each <tool_call> block is read by `call_of`. One that parses is a call (only
    the first, with tools.parallel false) and leaves the text with the whitespace just before
    it; one that does not stays in the text as written. A reply that made a call loses its
    trailing whitespace too: "I'll look.\n<tool_call>...</tool_call>\n" has content
    "I'll look."."""
    if tools is None or tools.mode == "none":
        return text, []
    if tools.forced:
        call = call_of(text, tools)
        return (None, [call]) if call is not None else (text, [])
    content, calls, at = "", [], 0
    for block in TOOL_CALL.finditer(text):
        before = text[at : block.start()]
        call = call_of(block.group(1), tools)
        if call is None:
            content += before + block.group(0)
        else:
            content = (content + before).rstrip()
            calls += [call] if tools.parallel or not calls else []
        at = block.end()
    content += text[at:]
    return (content.rstrip() or None, calls) if calls else (content, [])


class CallSplitter:
    """A reply of tool_choice "auto" split into content and calls as its text comes: pieces
    of text in (`push`), the content that can go out now and the calls just completed out.
    All the content pieces, `finish()` included, and all the calls are those `parsed_reply`
    reads from the whole text (the calls' ids aside: each call gets a new one).

    What is held back, and why:
    - outside a block, a tail that could still begin one: the longest suffix that is a prefix
      of "<tool_call>", and the whitespace before it (whitespace before a call is dropped, so
      it waits to see what follows it);
    - a block, from its "<tool_call>" until its "</tool_call>": then it is a call (if
      `call_of` reads one; with tools.parallel false, only the first is kept) or goes out as
      the text it was.
    `finish()` gives what is still held once the reply has ended: an unfinished block is
    text, and trailing whitespace is dropped if a call was made.

    The forced modes (required, a named function) do not use it: their reply is one JSON
    object, the call, sent in one delta at its end.
    """

    def __init__(self, tools: Tools):
        self.tools = tools
        self.calls: list[dict] = []  # every call made so far (a stream's tool_calls index)
        self._held = ""  # the text not yet decided on
        self._inside = False  # _held is a block's text after its <tool_call>
        self._space = ""  # inside a block: the whitespace before its <tool_call>

    def push(self, text: str) -> tuple[str, list[dict]]:
        """Take the next piece of the reply: (content to send now, calls completed by it)."""
        self._held += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._held.find(CLOSE)
                if end < 0:
                    return content, calls
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                content += self._close(body, calls)
                continue
            start = self._held.find(OPEN)
            if start < 0:
                return content + self._release(), calls
            before = self._held[:start]
            content += before.rstrip()
            self._space = before[len(before.rstrip()) :]
            self._held, self._inside = self._held[start + len(OPEN) :], True

    def finish(self) -> str:
        """The content still held, at the end of the reply."""
        text = self._space + OPEN + self._held if self._inside else self._held
        self._held, self._inside, self._space = "", False, ""
        return text.rstrip() if self.calls else text

    def _close(self, body: str, calls: list[dict]) -> str:
        """End the block of text `body`: a call (appended to `calls`; nothing goes out, not
        even the whitespace before it), or its text."""
        self._inside, space, self._space = False, self._space, ""
        call = call_of(body.strip(), self.tools)
        if call is None:
            return space + OPEN + body + CLOSE
        if self.tools.parallel or not self.calls:
            calls.append(call)
            self.calls.append(call)
        return ""

    def _release(self) -> str:
        """The held text outside a block that can go out: all but a tail that may begin a
        <tool_call>, and the whitespace before that tail."""
        held = self._held
        keep = next((n for n in range(len(OPEN) - 1, 0, -1) if held.endswith(OPEN[:n])), 0)
        out = held[: len(held) - keep].rstrip()
        self._held = held[len(out) :]
        return out


def call_of(text: str, tools: Tools) -> dict | None:
    """One call, {"name": N, "arguments": {...}} as JSON text naming one of the tools; None
    when the text is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tools.schemas:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    function = {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
