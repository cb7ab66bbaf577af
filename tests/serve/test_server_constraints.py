"""Constrained decoding through the real server and the official `openai` client: OpenAI's
response_format (json_object, json_schema) and vLLM's guided_json / guided_regex /
guided_choice, in completions and chat, on both engines; with an untrained tiny model and many
seeds every reply validates against its schema (`jsonschema`), fully matches its regex, or is
one of its choices. Bad constraints are OpenAI-shaped 400s naming the field."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.inference.test_constraints import CHOICES, REGEX, SCHEMA
from tests.serve.server_helpers import Server, engines, write_checkpoint

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

N, SEEDS = 10, tuple(range(0, 1000, 100))  # 100 replies per constraint (choice j: seed + j)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module", params=engines(), ids=lambda c: c.__name__)
def client(request, ckpt):
    server = Server(ckpt, request.param)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    server.close()


def completions(client, **extra) -> list[str]:
    texts = []
    for seed in SEEDS:
        out = client.completions.create(
            model="tiny",
            prompt="the cat",
            max_tokens=60,
            n=N,
            seed=seed,
            temperature=1.5,
            extra_body=extra,
        )
        assert all(c.finish_reason == "stop" for c in out.choices)
        texts += [c.text for c in out.choices]
    return texts


def chats(client, **fields) -> list[str]:
    texts = []
    for seed in SEEDS:
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a pet, as JSON"}],
            max_tokens=60,
            n=N,
            seed=seed,
            temperature=1.5,
            **fields,
        )
        assert all(c.finish_reason == "stop" for c in out.choices)
        texts += [c.message.content for c in out.choices]
    return texts


@pytest.mark.slow
def test_guided_fields_in_completions(client):
    for text in completions(client, guided_json=SCHEMA):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in completions(client, guided_regex=REGEX, top_k=20):
        assert re.fullmatch(REGEX, text), text
    assert set(completions(client, guided_choice=list(CHOICES))) <= set(CHOICES)


@pytest.mark.slow
def test_response_format_in_chat(client):
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for text in chats(client, response_format=schema_format):
        jsonschema.validate(json.loads(text), SCHEMA)
    small = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }  # json_object: any object; this one always ends
    format_ = {"type": "json_schema", "json_schema": {"name": "ok", "schema": small}}
    assert all(
        isinstance(json.loads(t)["ok"], bool) for t in chats(client, response_format=format_)
    )
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.slow
def test_requests_at_once_keep_their_own_constraints(client):
    """Requests with different constraints (and one with none) at once: the batched engine
    runs them as rows of one step, each with its own mask."""
    asks = [{"guided_regex": REGEX, "top_k": 20}, {"guided_choice": list(CHOICES)}]
    asks = (asks + [{"guided_json": SCHEMA}, {}]) * 3

    def text(extra: dict) -> str:
        out = client.completions.create(
            model="tiny",
            prompt="the cat",
            max_tokens=60,
            temperature=1.5,
            seed=1,
            extra_body=extra,
        )
        return out.choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        for extra, out in zip(asks, pool.map(text, asks)):
            if "guided_regex" in extra:
                assert re.fullmatch(REGEX, out), out
            elif "guided_choice" in extra:
                assert out in CHOICES
            elif "guided_json" in extra:
                jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"extra_body": {"guided_regex": "(cat"}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"type": "nonsense"}}}, "guided_json"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **fields
        )
    assert err.value.body["param"] == param, err.value.body


LONG = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2000}}}
LONG |= {"required": ["s"]}  # {"s":"...2000 characters..."}: 2008 bytes at least


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": LONG}}},
            "response_format",
        ),
        ({"max_completion_tokens": 16, "extra_body": {"guided_json": LONG}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(cat|dog){600}"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": ["x" * 300, "y" * 400]}}, "guided_choice"),
    ],
)
def test_a_constraint_max_tokens_cannot_finish_is_a_400_naming_it(client, fields, param):
    """The fewest bytes any accepted text has, over the longest token's bytes (6 for this
    vocabulary), is more than 16 tokens: refused before generating."""
    fields = {"max_tokens": 16} | fields if "max_completion_tokens" not in fields else fields
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], **fields
        )
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert "max_tokens=16" in body["message"] and "raise max_tokens" in body["message"]
    assert body["message"].startswith(f"{param}: ")


def test_the_completions_default_max_tokens_counts_too(client):
    """A completion's default max_tokens is 16: a constraint that needs more is refused unless
    the request raises it; one that fits runs."""
    fields = dict(model="tiny", prompt="the cat", extra_body={"guided_regex": "(cat){40}"})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**fields)
    assert err.value.body["param"] == "guided_regex"
    assert "max_tokens=16" in err.value.body["message"]
    out = client.completions.create(max_tokens=100, temperature=0, **fields)
    assert ("cat" * 40).startswith(out.choices[0].text)  # all of it, or cut by max_tokens
    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ok |= {"additionalProperties": False}  # {"ok":true}: 11 bytes, at most 11 tokens
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": ok}},
    )
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
