"""The real server on loopback, driven by the official `openai` client: completions, chat,
streaming, n, stop, seeds and logprobs, each checked against attnlab's own `generate` and the
model's full forward (not against the server itself)."""

from unittest.mock import Mock

import httpx
import openai
import pytest
import torch

from attnlab.inference.sampling import SamplingConfig
from attnlab.serve.types import QueueFull
from tests.serve.server_helpers import Server, engines, reference, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module", params=engines(), ids=lambda c: c.__name__)
def server(request, ckpt):
    s = Server(ckpt, request.param)
    yield s
    s.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def model_logprobs(server, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one full forward (no cache). -> (len(ids) - 1,)"""
    with torch.no_grad():
        logits = server.model(torch.tensor([ids]))[0].float()  # (T, V)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_greedy_completion_is_generate(server, client):
    ids = server.tokenizer.encode("the cat sat")
    r = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12, temperature=0)
    expected = reference(server, ids, 12)
    assert r.choices[0].text == server.tokenizer.decode(expected)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expected)
    assert r.choices[0].finish_reason == "length"


def test_token_id_prompts_and_a_list_of_prompts(server, client):
    a, b = server.tokenizer.encode("hello world"), server.tokenizer.encode("the dog ate the")
    r = client.completions.create(model="tiny", prompt=[a, b], max_tokens=6, temperature=0)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [server.tokenizer.decode(reference(server, p, 6)) for p in (a, b)]
    assert r.usage.prompt_tokens == len(a) + len(b)


def test_chat_uses_the_chat_template(server, client):
    messages = [{"role": "user", "content": "hello cat"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    ids = server.tokenizer.encode(server.tokenizer.apply_chat_template(messages))
    expected = reference(server, ids, 10, stops=("<eos>", "<|end|>"))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == server.tokenizer.decode(expected)
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_completion_equals_the_whole_answer(server, client):
    kw = dict(model="tiny", prompt="the dog", max_tokens=15, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15


def test_streaming_chat_equals_the_whole_answer(server, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=12)
    whole = client.chat.completions.create(**kw, temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_seeded_sampling_is_generate_with_that_seed(server, client):
    ids = server.tokenizer.encode("hello")
    kw = dict(model="tiny", prompt="hello", max_tokens=10, temperature=1.0, seed=1234)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert first.choices[0].text == again.choices[0].text
    expected = reference(server, ids, 10, SamplingConfig(temperature=1.0), seed=1234)
    assert first.choices[0].text == server.tokenizer.decode(expected)


def test_n_choices_are_distinct_and_reproducible(server, client):
    kw = dict(model="tiny", prompt="the", max_tokens=8, temperature=1.0, seed=7, n=3)
    r, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3  # choice j draws with seed + j
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=3
    )
    assert len(chat.choices) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(server, client, stream):
    ids = server.tokenizer.encode("the cat")
    full = server.tokenizer.decode(reference(server, ids, 20))
    stop = full[5:7]  # a piece of the greedy answer; it may first occur earlier
    kw = dict(model="tiny", prompt="the cat", max_tokens=20, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[: full.index(stop)] and finish == "stop"


def test_logprobs_are_the_models(server, client):
    prompt = server.tokenizer.encode("the mat")
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    out = reference(server, prompt, 6)
    lp = r.choices[0].logprobs
    expected = model_logprobs(server, prompt + out)[len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), expected, atol=1e-4, rtol=0)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy
    assert len(lp.tokens) == len(out) and "".join(lp.tokens[:1]) in r.choices[0].text


def test_echo_logprobs_score_the_prompt(server, client):
    ids = server.tokenizer.encode("the dog ate the bone")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "the dog ate the bone" and lp.token_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(lp.token_logprobs[1:]), model_logprobs(server, ids), atol=1e-4, rtol=0
    )


def test_echoed_prompt_top_logprobs_are_the_models_top_tokens(server, client):
    """lm-eval's is_greedy reads these: each echoed position's best entry is the argmax of a
    full forward there (not the prompt's own token), with the prompt token beside it."""
    from attnlab.serve.protocol import token_text

    ids = server.tokenizer.encode("the dog ate the bone")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        logp = torch.log_softmax(server.model(torch.tensor([ids]))[0].float(), dim=-1)  # (T, V)
    best = logp.argmax(-1).tolist()  # best[i - 1]: the model's top token at prompt position i
    assert lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        first = max(top, key=top.get)
        assert first == token_text(server.tokenizer, best[i - 1])
        assert top[first] == pytest.approx(logp[i - 1].max().item(), abs=1e-4)
        assert token_text(server.tokenizer, ids[i]) in top
    assert any(best[i - 1] != ids[i] for i in range(1, len(ids)))  # the prompt is not greedy


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_metrics_count_tokens(server, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    values = dict(
        line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    for name in ("running", "waiting", "kv_blocks_used", "time_to_first_token_seconds_count"):
        assert f"attnlab_{name}" in values
    assert float(values["attnlab_generation_tokens_total"]) >= 3
    assert "# TYPE attnlab_generation_tokens_total counter" in text


def test_remote_tokenizer_endpoints(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello cat"}).json()["tokens"]
    assert ids == server.tokenizer.encode("hello cat")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {
        "prompt": "hello cat"
    }
    assert httpx.get(f"{server.url}/tokenizer_info").json()["eos_token"] == "<eos>"


# --- errors: OpenAI-shaped, the client raises its typed exceptions, the server keeps serving ---
BAD_REQUESTS = {
    "missing prompt": {"model": "tiny", "prompt": None, "max_tokens": 3},
    "max_tokens 0": {"model": "tiny", "prompt": "a", "max_tokens": 0},
    "max_tokens -1": {"model": "tiny", "prompt": "a", "max_tokens": -1},
    "max_tokens beyond the context": {"model": "tiny", "prompt": "a", "max_tokens": 500},
    "temperature < 0": {"model": "tiny", "prompt": "a", "temperature": -0.5},
    "top_p 0": {"model": "tiny", "prompt": "a", "top_p": 0},
    "top_p > 1": {"model": "tiny", "prompt": "a", "top_p": 1.5},
    "token id outside the vocabulary": {"model": "tiny", "prompt": [1, 2, 10**6]},
    "negative token id": {"model": "tiny", "prompt": [[1, -3]]},
    "prompt longer than the context": {"model": "tiny", "prompt": list(range(200))},
    "n 0": {"model": "tiny", "prompt": "a", "n": 0},
    "stop not text": {"model": "tiny", "prompt": "a", "stop": 5},
    "stream not a boolean": {"model": "tiny", "prompt": "a", "stream": 3},
    "logprobs over 20": {"model": "tiny", "prompt": "a", "logprobs": 21},
}


@pytest.mark.parametrize("body", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_input_is_a_400_the_client_raises(server, client, body, monkeypatch):
    submitted = []
    monkeypatch.setattr(server.engine, "submit", lambda *a: submitted.append(a))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    assert not submitted  # checked before anything reaches the engine
    monkeypatch.undo()
    error = e.value.body
    assert set(error) >= {"message", "type", "param", "code"}  # the client unwraps "error"
    assert error["type"] == "invalid_request_error" and error["message"]
    assert client.completions.create(model="tiny", prompt="a", max_tokens=1).choices


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b'{"model": "tiny", "prompt": "' + b"a" * (10 * 2**20) + b'"}',
        b'{"model": "tiny", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    ],
    ids=["malformed JSON", "not an object", "a 10 MB prompt", "nested 3000 deep"],
)
def test_unreadable_bodies_are_400(server, content):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_an_unknown_model_is_a_404_the_client_raises(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="a")
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]


def test_a_tiny_top_p_samples_the_top_token(server, client):
    """top_p=1e-6 (inside (0, 1]) keeps only the most likely token: greedy, not a 500."""
    ids = server.tokenizer.encode("the mat")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, top_p=1e-6, seed=1)
    assert r.choices[0].text == server.tokenizer.decode(reference(server, ids, 4))


def test_a_text_plain_body_is_a_415(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "tiny", "prompt": "a"}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 415 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("engine_cls", engines(), ids=lambda c: c.__name__)
def test_more_choices_than_the_queue_holds_is_a_400_not_a_429(ckpt, engine_cls):
    """prompts x n > --max-queue could never be admitted, even idle: a 400 saying so (a 429
    would be retried forever); exactly --max-queue is served."""
    s = Server(ckpt, engine_cls, max_queue=8)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="can never fit") as e:
            client.completions.create(model="tiny", prompt="a", max_tokens=1, n=9)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError, match="3 prompts x n=3"):
            client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=1, n=3)
        r = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=1, n=4)
        assert len(r.choices) == 8
    finally:
        s.close()


def test_bad_chat_messages_are_400(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"content": "x"}])


def test_unknown_route_is_an_openai_shaped_404(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key(ckpt):
    s = Server(ckpt, api_key="s3cret")
    try:
        base = f"{s.url}/v1"
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=base, api_key=key or "-", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="a", max_tokens=2).choices
        assert httpx.get(f"{s.url}/health").status_code == 200  # probes need no key
    finally:
        s.close()


def test_a_full_queue_is_429_and_a_stopping_engine_503(ckpt, monkeypatch):
    s = Server(ckpt, max_queue=1)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0)
        with monkeypatch.context() as m:  # the one waiting place is taken
            m.setattr(s.engine, "submit", Mock(side_effect=QueueFull("the queue is full")))
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="tiny", prompt="a", max_tokens=2)
        assert e.value.body["type"] == "rate_limit_error"
        s.engine.stop(1)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="a", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable"
    finally:
        s.close()
