"""The chat page of `attnlab serve` in a real headless Chromium (the viewer test's browser and
flags): a reply streams in, Stop ends it and frees its engine request, the next turn sends the
whole conversation, which the server renders through the chat template, a reply's "attention"
button opens the viewer on that reply's tokens in a new tab, and New chat starts over. Every
request the pages make goes to the test server on 127.0.0.1 (the viewer is a blob: of it)."""

import json

import pytest

from attnlab.serve.attention import DEFAULT_LAST
from attnlab.serve.protocol import token_text
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
