"""The chat page of `attnlab serve` in a real headless Chromium (the viewer test's browser and
flags): a reply streams in, Stop ends it and frees its engine request, the next turn sends the
whole conversation, which the server renders through the chat template, a reply's "attention"
button opens the viewer on that reply's tokens in a new tab, and New chat starts over. Every
request the pages make goes to the test server on 127.0.0.1 (the viewer is a blob: of it).

Then the page's own features, on a server whose engine answers with given texts (ScriptedEngine)
through the real chat endpoint: Markdown drawn as markdown-it-py (the CommonMark reference port)
draws it, a reply's HTML kept as text, conversations that survive a reload, edit and
regenerate, the figures under a reply against the server's own counts, the sampler's boxes, the
adapter selector, and a narrow window."""

import html.parser
import json
import random
import re
import time

import pytest
import torch
from markdown_it import MarkdownIt

from attnlab.adapters.lora import add_lora, lora_modules
from attnlab.checkpoint import open_checkpoint
from attnlab.interop.peft import save_peft
from attnlab.serve.attention import DEFAULT_LAST
from attnlab.serve.protocol import token_text
from attnlab.serve.sequential import SequentialEngine
from attnlab.viz.capture import display_token
from tests.serve.server_helpers import Server, SlowEngine, write_checkpoint
from tests.serve.test_server_faults import eventually, idle, spy_cancels
from tests.viz.test_viewer_browser import browser_page  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


class SlowerEngine(SlowEngine):
    """50 ms a token: a reply of 60 tokens lasts 3 s, time to see it stream and stop it."""

    DELAY = 0.05


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(write_checkpoint(tmp_path_factory.mktemp("chat") / "tiny"), SlowerEngine)
    s.prompts = []  # the token ids of every request the engine was given
    submit = s.engine.submit

    def recorded(request, on_event):
        s.prompts.append(list(request.prompt_ids))
        return submit(request, on_event)

    s.engine.submit = recorded
    yield s
    s.close()


@pytest.fixture(scope="module")
def page(browser_page):  # noqa: F811 (the fixture imported above)
    """One headless Chromium page, as the viewer's browser test opens it."""
    return browser_page


def say(page, text: str, max_tokens: int) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#input", text)
    page.click("#send")


def last_reply(page, state: str) -> str:
    """The text of the last reply once it reaches `state` (done, stopped), as the page keeps
    it (drawn as Markdown, its text on screen may differ: a random model writes any bytes)."""
    page.wait_for_selector(f"#log .assistant:last-child[data-state={state}]", timeout=20000)
    return page.evaluate("() => chat().messages.at(-1).content")


def attention_tokens(page) -> list[str]:
    """Click the last reply's "attention" button: the query tokens of the viewer page that
    opens in a new tab (read from the data it embeds), once its script has drawn it."""
    with page.expect_popup() as popup:
        page.click("#log .assistant:last-child .attn")
    viewer = popup.value
    viewer.wait_for_url(lambda url: url.startswith("blob:"), timeout=20000)
    viewer.wait_for_selector("#queries .tok")  # the viewer's own script ran
    data = json.loads(viewer.eval_on_selector("#attn-data", "e => e.textContent"))
    viewer.close()
    return data["kinds"]["decoder_self"]["q_tokens"]


def sent_messages(bodies: list[dict]) -> list[dict]:
    return bodies[-1]["messages"]


def test_stream_stop_and_the_whole_history(server, page):
    errors, urls, bodies = [], [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: urls.append(r.url))
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.method == "POST" else None)
    every = []  # the requests of every tab, the viewer's included
    page.context.on("request", lambda r: every.append(r.url))
    cancelled = spy_cancels(server)
    page.goto(server.url + "/")
    page.fill("#system", "be brief")
    page.fill("#temperature", "0")

    say(page, "hello cat", 6)  # a whole reply
    first = last_reply(page, "done")
    assert first

    shown = attention_tokens(page)  # the viewer of this reply: the chat as rendered, the reply
    tokenizer = server.tokenizer
    asked = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello cat"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(asked))
    assert server.prompts[-1] == prompt  # what the reply was generated after
    ids = (prompt + tokenizer.encode(first))[-DEFAULT_LAST:]
    assert shown == [display_token(token_text(tokenizer, t)) for t in ids]

    say(page, "the dog", 60)  # tokens stream in; Stop ends the reply mid-way
    streaming = "#log .assistant:last-child[data-state=streaming]"
    page.wait_for_function(f"document.querySelector('{streaming}')?.textContent.length > 0")
    seen = len(page.eval_on_selector(streaming, "e => e.textContent"))
    page.wait_for_function(f"document.querySelector('{streaming}')?.textContent.length > {seen}")
    page.click("#stop")
    second = last_reply(page, "stopped")
    assert len(second) > seen
    eventually(lambda: cancelled and idle(server))  # the server released the request
    assert len(set(cancelled)) == 1  # the stopped one (a finished reply is never cancelled)
    assert server.engine.stats()["generation_tokens_total"] < 6 + 60

    say(page, "and the mat", 4)  # the whole conversation goes with the third turn
    last_reply(page, "done")
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello cat"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": second},
        {"role": "user", "content": "and the mat"},
    ]
    assert sent_messages(bodies) == history
    assert bodies[-1]["stream"] is True and bodies[-1]["max_tokens"] == 4
    assert server.prompts[-1] == tokenizer.encode(tokenizer.apply_chat_template(history))

    page.click("#new")  # a new chat: the system prompt and the new message only
    assert page.eval_on_selector_all("#log .msg", "ms => ms.length") == 0
    say(page, "hello", 2)
    last_reply(page, "done")
    assert sent_messages(bodies) == [history[0], {"role": "user", "content": "hello"}]

    assert errors == []
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls
    assert all(u.startswith((server.url + "/", "blob:" + server.url + "/")) for u in every), every


# --- the page's features, on scripted replies -------------------------------------------------
class ScriptedEngine(SequentialEngine):
    """Answers each request with the next text of `replies` (its tokens, then the first stop
    token, as a model ending its turn) in place of sampling; the rest is the real engine and
    server: the chat template, the stream, the finish reason, the usage."""

    replies: list[str]
    delay = 0.0  # seconds a token

    def _tokens(self, ids, p):
        logits = torch.zeros(self.vocab_size)  # what token_logprobs reads; unused here
        for t in [*self.tokenizer.encode(self.replies.pop(0)), p.stop_token_ids[0]]:
            time.sleep(self.delay)
            yield t, logits


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A ScriptedEngine server with one LoRA adapter, "sql", beside the base ("tiny")."""
    root = tmp_path_factory.mktemp("scripted")
    ckpt = write_checkpoint(root / "tiny", max_seq_len=1024)  # room for long replies
    loaded = open_checkpoint(ckpt)
    add_lora(loaded.model, ("q", "v"), rank=4, alpha=8.0)
    with torch.no_grad():
        for m in lora_modules(loaded.model).values():
            m.lora_B.normal_(0.0, 0.3)
    save_peft(loaded.model, loaded.config, root / "sql")
    s = Server(ckpt, ScriptedEngine, lora=[f"sql={root / 'sql'}"])
    s.engine.replies, s.requests = [], []
    submit = s.engine.submit

    def recorded(request, on_event):
        s.requests.append(request)
        return submit(request, on_event)

    s.engine.submit = recorded
    yield s
    s.close()


@pytest.fixture
def fresh(scripted, page):
    """The page on the scripted server, its storage empty; the bodies it POSTs to the chat
    endpoint (in `page.bodies`) and every URL it asks for (`page.urls`)."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(scripted.url + "/")
    page.evaluate("localStorage.clear()")
    page.reload()
    page.bodies, page.urls = [], []

    def seen(r):
        page.urls.append(r.url)
        if r.method == "POST" and r.url.endswith("/v1/chat/completions"):
            page.bodies.append(r.post_data_json)

    page.on("request", seen)
    page.wait_for_selector("#model option", state="attached")  # /v1/models and /props read
    yield page
    page.remove_listener("request", seen)
    assert all(u.startswith(scripted.url + "/") for u in page.urls), page.urls


def ask(page, server, message: str, reply: str) -> None:
    """Type `message` and Enter; the engine answers `reply`; wait until it is drawn."""
    server.engine.replies.append(reply)
    n = page.eval_on_selector_all("#log .assistant[data-state=done]", "e => e.length")
    page.fill("#input", message)
    page.press("#input", "Enter")
    page.wait_for_function(
        f"document.querySelectorAll('#log .assistant[data-state=done]').length > {n}"
        " && !document.querySelector('#log [data-state=streaming]')"
    )


def shown(page) -> list[tuple[str, str]]:
    """(role, text) of each message on screen."""
    js = "ms => ms.map(m => [m.classList[1], m.querySelector('.text').textContent])"
    return [tuple(m) for m in page.eval_on_selector_all("#log .msg", js)]


def tree(page, text: str) -> list:
    """The page's Markdown renderer on `text`, as nested [tag, children...] lists; a code block's
    box is its <pre><code> and text (its bar and its highlighting, tested apart, left out)."""
    js = """text => {
      const walk = n => n.nodeType === 3 ? n.textContent : n.classList.contains("code")
        ? ["pre", ["code", n.querySelector("pre").textContent]]
        : [n.tagName.toLowerCase(), ...[...n.childNodes].map(walk)];
      const box = document.createElement("div");
      box.appendChild(markdown(text));
      return walk(box).slice(1);
    }"""
    return normal(page.evaluate(js, text))


class Tree(html.parser.HTMLParser):
    """HTML text as the same nested lists."""

    def __init__(self):
        super().__init__()
        self.stack = [["root"]]

    def handle_starttag(self, tag, attrs):
        node = [tag]
        self.stack[-1].append(node)
        if tag not in ("br", "hr"):
            self.stack.append(node)

    def handle_endtag(self, tag):
        if tag not in ("br", "hr"):
            self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].append(data)


def normal(nodes: list, in_pre: bool = False) -> list:
    """Whitespace-only text dropped, runs of spaces and newlines one space (but in code
    blocks, whose text is kept less its final newline)."""
    out = []
    for n in nodes:
        if isinstance(n, list):
            out.append([n[0], *normal(n[1:], in_pre or n[0] == "pre")])
        elif in_pre:
            out.append(n.removesuffix("\n"))
        elif n.strip():
            out.append(re.sub(r"\s+", " ", n).strip())
    return out


REFERENCE = MarkdownIt("commonmark", {"breaks": True}).enable(["table", "strikethrough"])
DOCUMENTS = [
    "Here is **bold**, *em*, `code`, __strong__ and ~~gone~~.\nA second line.",
    "# Title\n\nSome text.\n\n## Sub\n\n- one\n- two\n  - nested\n- three\n\n1. first\n2. second",
    "Steps:\n1. open it\n2. *read* it\n\n3. c\n4. d",
    "```python\ndef f(x):\n    return x * 2\n```\n\nAfter the code, `inline <b>` code.",
    "| name | value |\n|------|:-----:|\n| a | **2** |\n| b | `3` |",
    "> quoted *text*\n> on two lines\n\n---\n\n[a link](https://example.org/x) and snake_case_word",
    "~~~\nraw <b>bold</b> & text\n~~~\n\n### Heading *em* ###\n\n* star\n* list",
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_markdown_is_drawn_as_markdown_it_draws_it(fresh, text):
    expected = Tree()
    expected.feed(REFERENCE.render(text))
    assert tree(fresh, text) == normal(expected.stack[0][1:])


def test_a_markdown_reply_streams_in_as_a_code_block_with_its_figures(scripted, fresh):
    page, tok = fresh, scripted.tokenizer
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=scripted.url)
    reply = "Use this:\n\n```python\nprint('hi')\n```\n\nThen **run** it."
    ask(page, scripted, "how do I print?", reply)
    last = "#log .assistant:last-child"
    assert page.eval_on_selector(f"{last} .code pre code", "e => e.textContent") == "print('hi')"
    assert page.eval_on_selector(f"{last} .code .lang", "e => e.textContent") == "python"
    assert page.eval_on_selector(f"{last} .text strong", "e => e.textContent") == "run"
    page.click(f"{last} .code .copy")
    page.wait_for_function(f"document.querySelector('{last} .copy').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi')"

    js = "ss => Object.fromEntries(ss.map(s => [s.dataset.name, s.dataset.value]))"
    figures = page.eval_on_selector_all(f"{last} .meta span", js)
    messages = [{"role": "user", "content": "how do I print?"}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    assert list(scripted.requests[-1].prompt_ids) == prompt
    assert int(figures["prompt_tokens"]) == len(prompt)
    assert int(figures["completion_tokens"]) == len(tok.encode(reply)) + 1  # + the end of turn
    assert figures["finish_reason"] == "stop" and figures["model"] == "tiny"
    assert float(figures["tokens_per_second"]) > 0
    assert fresh.bodies[-1]["stream_options"] == {"include_usage": True}


def test_html_in_a_reply_stays_text(scripted, fresh):
    page = fresh
    attack = (
        "<script>window.pwned = 1</script>\n"
        '<img src="x" onerror="window.pwned = 2">\n\n'
        "`<b>code</b>` and [click](javascript:window.pwned=3) <a href=x>raw</a>\n\n"
        "```html\n<script>window.pwned = 4</script>\n```"
    )
    ask(page, scripted, "<i>hi</i> <img src=y onerror='window.pwned = 5'>", attack)
    page.reload()  # drawn again from storage, too
    page.wait_for_selector("#log .assistant[data-state=done]")
    made = "#log script, #log img, #log b, #log i, #log a"
    assert page.eval_on_selector_all(made, "e => e.length") == 0
    assert page.evaluate("window.pwned") is None
    text = page.eval_on_selector("#log .assistant .text", "e => e.textContent")
    assert "<script>window.pwned = 1</script>" in text and 'onerror="window.pwned = 2"' in text
    assert "<a href=x>raw</a>" in text and "<script>window.pwned = 4</script>" in text
    assert shown(page)[0] == ("user", "<i>hi</i> <img src=y onerror='window.pwned = 5'>")


def test_conversations_survive_a_reload_and_switch_rename_delete(scripted, fresh):
    page = fresh
    ask(page, scripted, "first chat", "reply one")
    ask(page, scripted, "more", "reply two")
    page.click("#new")
    ask(page, scripted, "second chat", "reply three")
    page.reload()
    page.wait_for_selector("#log .assistant")
    assert shown(page) == [("user", "second chat"), ("assistant", "reply three")]
    titles = page.eval_on_selector_all("#chats .open", "bs => bs.map(b => b.textContent)")
    assert titles == ["second chat", "first chat"]  # the newest first

    page.click("#chats li:nth-child(2) .open")
    first = [("user", "first chat"), ("assistant", "reply one")]
    assert shown(page) == first + [("user", "more"), ("assistant", "reply two")]
    page.click("#chats li.current .rename")
    page.fill("#chats li input", "renamed")
    page.press("#chats li input", "Enter")
    ask(page, scripted, "third turn", "reply four")  # the next turn sends this chat's history
    assert [m["content"] for m in fresh.bodies[-1]["messages"]] == [
        "first chat",
        "reply one",
        "more",
        "reply two",
        "third turn",
    ]
    page.reload()
    page.wait_for_selector("#log .assistant")
    titles = page.eval_on_selector_all("#chats .open", "bs => bs.map(b => b.textContent)")
    assert titles == ["renamed", "second chat"] and len(shown(page)) == 6
    page.click("#chats li.current .rename")  # Esc: the old title stays
    page.fill("#chats li input", "not this")
    page.press("#chats li input", "Escape")
    assert page.text_content("#chats li.current .open") == "renamed"

    page.click("#chats li.current .delete")
    page.reload()
    page.wait_for_selector("#log .assistant")
    titles = page.eval_on_selector_all("#chats .open", "bs => bs.map(b => b.textContent)")
    assert titles == ["second chat"] and shown(page)[0] == ("user", "second chat")


def test_edit_and_regenerate_send_the_edited_history(scripted, fresh):
    page = fresh
    page.fill("#system", "be brief")
    ask(page, scripted, "hello", "hi there")
    page.fill("#input", "two")  # Shift+Enter: a new line, not a send
    page.press("#input", "Shift+Enter")
    page.type("#input", "lines")
    scripted.engine.replies.append("second reply")
    page.press("#input", "Enter")
    page.wait_for_selector("#log .assistant:nth-child(4)[data-state=done]")
    assert fresh.bodies[-1]["messages"][-1] == {"role": "user", "content": "two\nlines"}

    page.click("#log .user:nth-child(3) .edit")  # edit the second turn, send it again
    page.fill("#log .edit textarea", "edited turn")
    scripted.engine.replies.append("edited reply")
    page.click("#log .edit .resend")
    page.wait_for_selector("#log .assistant:nth-child(4)[data-state=done]")
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "edited turn"},
    ]
    assert fresh.bodies[-1]["messages"] == history
    tok = scripted.tokenizer
    assert list(scripted.requests[-1].prompt_ids) == tok.encode(tok.apply_chat_template(history))
    assert shown(page)[2:] == [("user", "edited turn"), ("assistant", "edited reply")]

    scripted.engine.replies.append("regenerated")
    page.click("#log .assistant:last-child .regenerate")
    page.wait_for_function(
        "document.querySelector('#log .assistant:last-child .text')?.textContent === 'regenerated'"
    )
    assert fresh.bodies[-1]["messages"] == history and len(fresh.bodies) == 4
    assert page.eval_on_selector_all("#log .regenerate", "e => e.length") == 1  # the last only

    which = "#log .msg:nth-child({}) .which"  # branches: what was replaced is kept
    assert page.text_content(which.format(4)) == "2/2"
    page.click("#log .msg:nth-child(4) .prev")
    assert shown(page)[3] == ("assistant", "edited reply")
    assert (
        page.text_content(which.format(4)) == "1/2" and page.text_content(which.format(3)) == "2/2"
    )
    page.click("#log .msg:nth-child(3) .prev")  # the turn before its edit, and its reply
    assert shown(page)[2:] == [("user", "two\nlines"), ("assistant", "second reply")]
    page.reload()  # the branches are kept with the conversation
    page.wait_for_selector("#log .assistant")
    assert page.text_content(which.format(3)) == "1/2"
    ask(page, scripted, "on this branch", "yes")
    assert [m["content"] for m in fresh.bodies[-1]["messages"]] == [
        "be brief",
        "hello",
        "hi there",
        "two\nlines",
        "second reply",
        "on this branch",
    ]
    page.click("#log .msg:nth-child(3) .next")
    # back on the edited branch, as it was left: its reply's first version
    assert shown(page)[2:] == [("user", "edited turn"), ("assistant", "edited reply")]
    page.fill("#system", "")


def test_the_sampler_boxes_show_the_defaults_and_refuse_out_of_range_values(scripted, fresh):
    page, defaults = fresh, scripted.app.state.settings.chat_sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        placeholder = page.get_attribute(f"#{name}", "placeholder")
        assert float(placeholder) == getattr(defaults, name), name
    page.fill("#top_p", "1.5")
    page.fill("#input", "hello")
    page.press("#input", "Enter")
    assert "top_p must be in (0, 1], got 1.5" in page.text_content("#status")
    assert "invalid" in page.get_attribute("#top_p", "class") and fresh.bodies == []
    page.fill("#top_p", "0.9")
    page.fill("#json_schema", "{not json")
    page.press("#input", "Enter")
    assert "JSON schema" in page.text_content("#status") and fresh.bodies == []

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    page.fill("#json_schema", json.dumps(schema))
    for name, value in [("top_k", "5"), ("min_p", "0.1"), ("repetition_penalty", "1.1")]:
        page.fill(f"#{name}", value)
    page.fill("#seed", "7")
    ask(page, scripted, "hello", '{"a": 1}')
    body = fresh.bodies[-1]
    assert (body["top_p"], body["top_k"], body["min_p"]) == (0.9, 5, 0.1)
    assert (body["repetition_penalty"], body["seed"]) == (1.1, 7)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema},
    }
    params = scripted.requests[-1].params  # as the server read them
    assert (params.top_k, params.min_p, params.seed, params.constraint is not None) == (
        5,
        0.1,
        7,
        True,
    )

    page.fill("#extra", "[1, 2]")  # the extra fields: an object, merged into the request
    page.fill("#input", "again")
    page.press("#input", "Enter")
    assert "the extra fields must be a JSON object" in page.text_content("#status")
    page.fill("#extra", json.dumps({"presence_penalty": 0.5, "stop": ["\n\n"], "stream": False}))
    ask(page, scripted, "again", "ok")
    assert fresh.bodies[-1]["presence_penalty"] == 0.5 and fresh.bodies[-1]["stream"] is True
    params = scripted.requests[-1].params
    assert params.presence_penalty == 0.5 and params.stop == ("\n\n",)
    names = ("top_p", "top_k", "min_p", "repetition_penalty", "seed", "json_schema", "extra")
    for name in names:
        page.fill(f"#{name}", "")


def test_the_model_selector_lists_the_adapters_and_sends_model(scripted, fresh):
    page = fresh
    options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert options == ["tiny", "sql"]  # /v1/models: the base, then the adapter
    page.select_option("#model", "sql")
    ask(page, scripted, "select it", "from the adapter")
    assert fresh.bodies[-1]["model"] == "sql" and scripted.requests[-1].adapter == 1
    model = "#log .assistant:last-child .meta [data-name=model]"
    assert page.get_attribute(model, "data-value") == "sql"  # the server's answer says so
    page.fill("#temperature", "0.3")
    page.fill("#key", "s3cret")  # (this server has none: the key is sent and ignored)
    page.reload()  # the choice is kept, as the settings are, but the API key
    page.wait_for_selector("#model option", state="attached")
    assert page.eval_on_selector("#model", "s => s.value") == "sql"
    assert page.input_value("#temperature") == "0.3" and page.input_value("#key") == ""
    page.fill("#temperature", "")
    page.select_option("#model", "tiny")


def test_a_phone_width_window(scripted, fresh):
    page = fresh
    page.set_viewport_size({"width": 390, "height": 800})
    wide = "| a | b | c |\n|---|---|---|\n| " + "long " * 30 + "| 2 | 3 |\n\n```\n" + "x" * 300
    ask(page, scripted, "a wide reply", wide + "\n```")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing spills over
    assert not page.is_visible("aside") and page.is_visible("#menu")
    page.click("#menu")
    assert page.is_visible("#temperature")
    page.click("#new")  # closes the panel
    assert not page.is_visible("aside") and page.is_visible("#input")


def test_export_import_and_search(scripted, fresh, tmp_path):
    """Export writes what `attnlab chat`'s /save writes (OpenAI's messages, the system prompt
    first); Import reads such a file (or a request's {messages}) into a new conversation."""
    page = fresh
    page.fill("#system", "be brief")
    ask(page, scripted, "hello cat", "hi there")
    with page.expect_download() as download:
        page.click("#export")
    messages = json.loads(open(download.value.path()).read())
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello cat"},
        {"role": "assistant", "content": "hi there"},
    ]
    saved = tmp_path / "from the terminal.json"
    turns = [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "woof"}]
    saved.write_text(json.dumps({"messages": [{"role": "system", "content": "be kind"}, *turns]}))
    page.set_input_files("#import-file", str(saved))
    page.wait_for_function(
        "document.querySelector('#chats li.current .open').textContent === 'from the terminal'"
    )
    assert shown(page) == [("user", "the dog"), ("assistant", "woof")]
    assert page.input_value("#system") == "be kind"
    ask(page, scripted, "and then?", "sat")  # the imported turns go with the next one
    assert fresh.bodies[-1]["messages"] == [
        {"role": "system", "content": "be kind"},
        *turns,
        {"role": "user", "content": "and then?"},
    ]
    (tmp_path / "bad.json").write_text('[{"role": "robot"}]')
    page.set_input_files("#import-file", str(tmp_path / "bad.json"))
    page.wait_for_function("document.querySelector('#status').textContent.includes('bad.json')")
    assert "not a list of {role, content} messages" in page.text_content("#status")

    page.fill("#search", "WOOF")  # a reply's text, any case
    titles = page.eval_on_selector_all("#chats .open", "bs => bs.map(b => b.textContent)")
    assert titles == ["from the terminal"]
    page.fill("#search", "")
    assert len(page.eval_on_selector_all("#chats .open", "bs => bs")) == 2
    page.fill("#system", "")


def test_a_dark_theme_where_the_system_asks_for_one(fresh):
    background = "getComputedStyle(document.body).backgroundColor"
    assert fresh.evaluate(background) == "rgb(255, 255, 255)"
    fresh.emulate_media(color_scheme="dark")
    assert fresh.evaluate(background) == "rgb(27, 28, 31)"
    fresh.emulate_media(color_scheme="light")


def test_esc_stops_a_reply(scripted, fresh):
    page, cancelled = fresh, spy_cancels(scripted)
    scripted.engine.delay = 0.05
    try:
        scripted.engine.replies.append("word " * 100)
        page.fill("#input", "talk")
        page.press("#input", "Enter")
        streaming = "#log .assistant:last-child[data-state=streaming] .text"
        page.wait_for_function(f"document.querySelector('{streaming}')?.textContent.length > 10")
        page.keyboard.press("Escape")
        page.wait_for_selector("#log .assistant:last-child[data-state=stopped]")
        eventually(lambda: cancelled and idle(scripted))  # the server let the request go
    finally:
        scripted.engine.delay = 0.0
    reply = page.evaluate("() => chat().messages.at(-1)")
    assert 0 < len(reply["content"]) < len("word " * 100)
    assert reply["figures"]["finish_reason"] == "stopped by the user"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


SNIPPETS = {
    "python": (
        "import os\nfrom math import sqrt  # a comment\n\n"
        'def square(x, n=2):\n    """Docstring."""\n'
        "    if x is not None and n > 0:\n        return x ** n * 1.5e3\n"
        "    return 'no\\'ne'\n\nclass A:\n    pass\n"
    ),
    "js": (
        "// add two numbers\nconst add = (a, b) => a + b;\n"
        'let s = "x\\"y" + \'z\' + `t`;\n'
        "function f(n) { if (n === 0x1F) { return null; } /* block */ return new Date(); }\n"
    ),
    "bash": "# install\nfor f in *.txt; do\n  echo \"file\" 'done'\ndone\nexit 1\n",
}


def pygments_spans(lang: str, code: str) -> list[tuple[str, str]]:
    """Pygments' tokens as the page's kinds: k (a keyword, or a word operator such as `and`),
    s (a string), c (a comment), n (a number), adjacent ones of a kind joined."""
    from pygments import lex
    from pygments.lexers import get_lexer_by_name
    from pygments.token import Comment, Keyword, Number, Operator, String

    kinds = [(Keyword, "k"), (Operator.Word, "k"), (String, "s"), (Comment, "c"), (Number, "n")]
    out = []
    for kind, text in lex(code, get_lexer_by_name(lang)):
        mine = next((k for t, k in kinds if kind in t), None)
        if mine and out and out[-1][0] == mine and out[-1][2]:
            out[-1] = (mine, out[-1][1] + text, True)
        else:
            out.append((mine, text, mine is not None))
    # (a comment's newline, which Pygments' bash lexer puts in it, is the text after it here)
    return [(k, text.rstrip("\n") if k == "c" else text) for k, text, marked in out if marked]


@pytest.mark.parametrize("lang", SNIPPETS)
def test_code_is_highlighted_as_pygments_lexes_it(fresh, lang):
    js = """([code, lang]) => {
      const into = document.createElement("code");
      highlight(into, code, lang);
      return [...into.childNodes].filter(n => n.nodeType === 1)
        .map(n => [n.className.slice(4), n.textContent]);
    }"""
    spans = [tuple(s) for s in fresh.evaluate(js, [SNIPPETS[lang], lang])]
    assert spans == pygments_spans(lang, SNIPPETS[lang])
    text = fresh.evaluate(
        "([c, l]) => { const e = document.createElement('code'); highlight(e, c, l);"
        " return e.textContent; }",
        [SNIPPETS[lang], lang],
    )
    assert text == SNIPPETS[lang]  # every character kept, in order


def test_a_reasoning_models_think_block_is_folded_away(scripted, fresh):
    page = fresh
    ask(page, scripted, "hi", "<think>the user <b>greets</b> me</think>Hello **there**")
    last = "#log .assistant:last-child"
    folded = page.eval_on_selector(f"{last} details.reasoning div", "e => e.textContent")
    assert folded == "the user <b>greets</b> me"
    assert not page.is_visible(f"{last} details.reasoning div")  # folded until opened
    assert page.eval_on_selector(f"{last} .text strong", "e => e.textContent") == "there"
    assert page.eval_on_selector_all("#log b, #log think", "e => e.length") == 0


def test_a_refused_regenerate_gives_the_reply_back(scripted, fresh):
    """The server answers a 400 (a field out of range, sent through the extra fields box, which
    the page leaves to the server): the error is said, and the reply it was to replace is back."""
    page = fresh
    ask(page, scripted, "hello", "first version")
    page.fill("#extra", '{"temperature": 5}')
    page.click("#log .assistant:last-child .regenerate")
    page.wait_for_selector("#log .error")
    assert "temperature must be in [0, 2], got 5" in page.text_content("#status")
    page.fill("#extra", "")
    page.reload()
    page.wait_for_selector("#log .assistant")
    assert shown(page) == [("user", "hello"), ("assistant", "first version")]
    assert page.eval_on_selector_all("#log .branch", "e => e.length") == 0  # one version only


def test_text_files_go_into_the_message(scripted, fresh, tmp_path):
    page = fresh
    (tmp_path / "notes.txt").write_text("a line\nwith ``` inside\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\xff")
    page.set_input_files("#attach-file", [str(tmp_path / "notes.txt"), str(tmp_path / "blob.bin")])
    page.wait_for_selector("#files .file")
    assert "blob.bin is not attached: only text files" in page.text_content("#status")
    assert page.eval_on_selector_all("#files .file", "fs => fs.length") == 1
    ask(page, scripted, "read this", "done")
    sent = fresh.bodies[-1]["messages"][-1]["content"]
    assert sent == "read this\n\nnotes.txt:\n````\na line\nwith ``` inside\n````"
    assert page.eval_on_selector_all("#files .file", "fs => fs.length") == 0  # sent with it


def test_any_text_makes_only_the_renderers_own_elements(fresh):
    """500 random texts of Markdown and HTML pieces: the renderer never throws, and it makes
    only its own tags, with only its own attributes (a link's href http(s) or mailto)."""
    pieces = [
        "**",
        "*",
        "_",
        "`",
        "```",
        "~~~",
        "~~",
        "# ",
        "> ",
        "- ",
        "1. ",
        "|",
        "---",
        "\n",
        "\n\n",
        "  ",
        "<script>x()</script>",
        "<img src=x onerror=y()>",
        "[a](",
        ")",
        "javascript:alert(1)",
        "https://e.org",
        "<think>",
        "</think>",
        "text",
        "<b>",
        "\\",
    ]
    rng = random.Random(0)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    js = """texts => texts.flatMap(t => {
      const box = document.createElement("div");
      drawReply(box, t);
      return [...box.querySelectorAll("*")].map(e => [e.tagName.toLowerCase(),
        [...e.attributes].map(a => a.name + "=" + a.value)]);
    })"""
    made = fresh.evaluate(js, texts)
    tags = {
        "p",
        "br",
        "strong",
        "em",
        "s",
        "code",
        "a",
        "span",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "hr",
        "ul",
        "ol",
        "li",
        "blockquote",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
        "div",
        "pre",
        "button",
        "details",
        "summary",
    }
    assert {tag for tag, _ in made} <= tags
    for _, attributes in made:
        for a in attributes:
            name, _, value = a.partition("=")
            assert name in {"class", "type", "title", "start", "style", "href", "target", "rel"}, a
            if name == "href":
                assert value.startswith(("https:", "http:", "mailto:")), a


def test_a_refused_turn_stays_to_send_again(scripted, fresh):
    page = fresh
    page.fill("#extra", '{"top_k": -5}')  # the server's 400, in OpenAI's shape
    page.fill("#input", "hello")
    page.press("#input", "Enter")
    page.wait_for_selector("#log .error")
    assert "top_k must be -1 or 0 (off), or >= 1, got -5" in page.text_content("#log .error")
    page.fill("#extra", "")
    page.reload()
    page.wait_for_selector("#log .user")
    assert shown(page) == [("user", "hello")]
    scripted.engine.replies.append("hi")
    page.click("#log .user .regenerate")  # "Send again"
    page.wait_for_selector("#log .assistant[data-state=done]")
    assert shown(page) == [("user", "hello"), ("assistant", "hi")]
    assert fresh.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]
