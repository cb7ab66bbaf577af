"""The chat page at / of `attnlab serve` (serve/static/chat.html): served, switched off by
--no-ui, open without the API key (the /v1 API behind it is not)."""

import argparse

from fastapi.testclient import TestClient

from attnlab.cli.serve import add_parser
from attnlab.inference.sampling import SamplingConfig
from attnlab.serve.app import create_app
from attnlab.serve.protocol import Settings


def client(**settings) -> TestClient:
    """The app without its lifespan (the engine never starts: the page does not need it)."""
    return TestClient(create_app(None, None, Settings("tiny", 64, 320, **settings)))


def test_the_page_is_served_at_the_root():
    r = client().get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "<title>attnlab chat</title>" in r.text
    assert "http://" not in r.text.replace("http://127.0.0.1", "")  # nothing from outside


def test_no_ui_serves_no_page():
    r = client(ui=False).get("/")
    assert r.status_code == 404
    assert r.json()["error"]["message"]  # OpenAI's error shape, as every other 404


def test_the_page_needs_no_key_but_the_api_does():
    c = client(api_key="s3cret")
    assert c.get("/").status_code == 200
    assert c.get("/v1/models").status_code == 401


def test_the_no_ui_flag():
    p = argparse.ArgumentParser()
    add_parser(p)
    assert p.parse_args(["--ckpt", "x"]).ui is True
    assert p.parse_args(["--ckpt", "x", "--no-ui"]).ui is False


def test_props_gives_the_chat_defaults_the_page_shows():
    """llama.cpp's /props names: the sampler a chat reply takes where a field is left out."""
    sampling = SamplingConfig(temperature=0.6, top_k=None, top_p=0.9, repetition_penalty=1.1)
    props = client(chat_sampling=sampling).get("/props").json()
    assert props["model"] == "tiny" and props["n_ctx"] == 64
    assert props["default_generation_settings"] == {
        "temperature": 0.6,
        "top_k": None,
        "top_p": 0.9,
        "min_p": None,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
