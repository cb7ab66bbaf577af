"""POST /v1/attention (serve/attention.py), through both engines: the page's maps are those
`capture_attention` takes from the same model and text run directly, a capture between the steps
of streaming requests leaves their tokens attnlab's own generation, and bad input is a 400 in
OpenAI's shape naming the field."""

import json
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.app import create_app
from attnlab.serve.attention import DEFAULT_LAST
from attnlab.serve.protocol import Settings
from attnlab.viz.capture import capture_attention, display_token
from attnlab.viz.viewer import STORED_DIGITS
from tests.serve.server_helpers import TEXT, Server, engines, reference, write_checkpoint
from tests.viz.test_viewer import embedded

STORED = (
    0.5 * 10**-STORED_DIGITS + 1e-9
)  # a weight stored with STORED_DIGITS decimals is this close
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello cat"},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("attention") / "tiny")


@pytest.fixture(scope="module", params=engines(), ids=lambda c: c.__name__)
def server(request, ckpt):
    s = Server(ckpt, request.param)
    yield s
    s.close()


def page(server, body: dict) -> dict:
    """The viewer data embedded in the page /v1/attention answers `body` with."""
    r = httpx.post(f"{server.url}/v1/attention", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    return embedded(r.text)


def direct(server, ids: list[int], layers=None, heads=None):
    """The reference: capture_attention on the served model, run directly on `ids`."""
    with torch.no_grad(), capture_attention(server.model, layers, heads) as maps:
        server.model(torch.tensor([ids]))
    return maps


def assert_shows(data: dict, maps, ids: list[int], n: int, tokenizer) -> None:
    """The page shows the last n tokens of `ids` (the tokenizer's pieces) and, for every layer
    and head, the last n queries over the last n keys of the reference maps."""
    kind = data["kinds"]["decoder_self"]
    pieces = [display_token(tokenizer.decode([t], skip_special=False)) for t in ids[-n:]]
    assert kind["q_tokens"] == kind["k_tokens"] == pieces
    assert kind["layers"] == sorted(maps["decoder_self"])
    for j, layer in enumerate(kind["layers"]):
        got = torch.tensor(kind["weights"][j], dtype=torch.float64)  # (H, n, n)
        want = maps["decoder_self"][layer][0, :, -n:, -n:].double()
        assert got.shape == want.shape
        assert (got - want).abs().max() <= STORED


def test_a_reply_shows_the_maps_of_the_chat_as_rendered_then_the_reply(server):
    reply = "the dog ate the bone"
    data = page(server, {"messages": CHAT, "reply": reply})
    tok = server.tokenizer
    ids = tok.encode(tok.apply_chat_template(CHAT)) + tok.encode(reply)  # chat's prompt, reply
    assert len(ids) < DEFAULT_LAST  # the whole text shown: each row a whole distribution
    assert_shows(data, direct(server, ids), ids, len(ids), tok)
    weights = torch.tensor(data["kinds"]["decoder_self"]["weights"], dtype=torch.float64)
    sums = weights.sum(-1)  # (L, H, T): each of T stored weights rounded
    assert (sums - 1).abs().max() <= len(ids) * STORED
    assert (weights.triu(1) == 0).all()  # causal: no query reads a later key
    assert data["kinds"]["decoder_self"]["heads"] == [0, 1, 2, 3]


def test_a_long_text_shows_its_last_tokens(server):
    text = TEXT[:300]
    ids = server.tokenizer.encode(text)
    assert len(ids) > DEFAULT_LAST
    data = page(server, {"prompt": text})
    assert_shows(data, direct(server, ids), ids, DEFAULT_LAST, server.tokenizer)
    assert f"last {DEFAULT_LAST} of {len(ids)} tokens" in data["title"]


def test_chosen_layers_heads_and_last(server):
    ids = server.tokenizer.encode("the cat sat on the mat")
    data = page(
        server, {"prompt": "the cat sat on the mat", "layers": [1], "heads": [2, 0], "last": 4}
    )
    assert data["kinds"]["decoder_self"]["heads"] == [2, 0]
    assert_shows(data, direct(server, ids, [1], [2, 0]), ids, 4, server.tokenizer)


def stream_completion(url: str, body: dict, started: threading.Event, out: dict) -> None:
    """Stream a completion, setting `started` at its first text; out["text"] is the whole text."""
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                if text:
                    started.set()
    out["text"] = text


def test_a_capture_between_the_steps_of_streams_leaves_them_as_generate(server, monkeypatch):
    """Captures while three requests stream (each token 10 ms late, so they outlast the
    captures): the streams' tokens are still attnlab's own generation for each alone, greedy
    and seeded, and each capture is still the direct one."""
    submit = server.engine.submit

    def slow(request, on_event):
        def late(event):
            threading.Event().wait(0.01)
            on_event(event)

        return submit(request, late)

    ids = server.tokenizer.encode("hello cat")
    want_maps = direct(server, ids)  # before the streams: a capture here would catch their steps
    monkeypatch.setattr(server.engine, "submit", slow)
    prompts = ["the cat sat", "hello world", "the dog ate the"]
    seeds = [None, 11, 12]
    outs, threads, started = [{} for _ in prompts], [], threading.Event()
    for prompt, seed, out in zip(prompts, seeds, outs):
        body = {"prompt": prompt, "max_tokens": 50, "stream": True, "ignore_eos": True}
        body |= {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        t = threading.Thread(target=stream_completion, args=(server.url, body, started, out))
        t.start()
        threads.append(t)
    assert started.wait(30)
    for _ in range(3):
        assert_shows(
            page(server, {"prompt": "hello cat"}), want_maps, ids, len(ids), server.tokenizer
        )
    overlapped = any(t.is_alive() for t in threads)  # the captures ran while some streamed
    for t in threads:
        t.join(60)
    assert overlapped
    for prompt, seed, out in zip(prompts, seeds, outs):
        sampling = None if seed is None else SamplingConfig(temperature=1.0)
        want = reference(server, server.tokenizer.encode(prompt), 50, sampling, seed, stops=())
        assert out["text"] == server.tokenizer.decode(want)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["the"]}, "prompt"),
        ({"messages": [], "reply": "x"}, "messages"),
        ({"messages": CHAT, "reply": 3}, "reply"),
        ({"messages": CHAT, "reply": "x", "prompt": "y"}, "prompt"),
        ({"prompt": "the cat", "layers": [2]}, "layers"),
        ({"prompt": "the cat", "layers": [0, 0]}, "layers"),
        ({"prompt": "the cat", "heads": [4]}, "heads"),
        ({"prompt": "the cat", "heads": []}, "heads"),
        ({"prompt": "the cat", "last": 0}, "last"),
        ({"prompt": TEXT}, "prompt"),  # 153 tokens: over the context of 128
        ({"messages": [{"role": "user", "content": TEXT}], "reply": ""}, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/attention", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_an_encoder_decoder_model_is_a_400(ckpt):
    """The CLI serves decoder-only models only; an app given another still answers in one line
    (checked before any job: this engine never runs)."""
    torch.manual_seed(0)
    engine = SimpleNamespace(model=build_model(get_preset("transformer-tiny")).eval())
    tokenizer = open_checkpoint(ckpt).tokenizer
    app = create_app(engine, tokenizer, Settings("tiny", 128, tokenizer.vocab_size))
    r = TestClient(app).post("/v1/attention", json={"prompt": "the cat"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert "decoder-only" in r.json()["error"]["message"]
