"""The full sampler through the real server and the official `openai` client: top_k, min_p,
the presence / frequency / repetition penalties, logit_bias, ignore_eos, min_tokens, chat
top_logprobs and stream_options.include_usage, each equal to attnlab's own `generate` with the
same settings (itself checked against transformers' processors in
tests/inference/test_sampler_references.py) or to the model's full forward; requests with
different samplers at once (batched by the Engine) each get their own; bad values are
OpenAI-shaped 400s naming the field."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from attnlab.inference.sampling import SamplingConfig
from attnlab.serve.protocol import token_text
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


# Each request body's sampler fields, and the SamplingConfig they must mean.
SAMPLERS = {
    "top_k": ({"top_k": 3, "temperature": 1.0}, SamplingConfig(top_k=3)),
    "min_p": ({"min_p": 0.3, "temperature": 1.5}, SamplingConfig(temperature=1.5, min_p=0.3)),
    "presence+frequency": (
        {"presence_penalty": 1.2, "frequency_penalty": 0.8, "temperature": 0},
        SamplingConfig(temperature=0, presence_penalty=1.2, frequency_penalty=0.8),
    ),
    "repetition": (
        {"repetition_penalty": 1.7, "temperature": 0.8},
        SamplingConfig(temperature=0.8, repetition_penalty=1.7),
    ),
    "logit_bias": (
        {"logit_bias": {"40": 6.0, "41": 5.0, "42": -100}, "temperature": 0},
        SamplingConfig(temperature=0, logit_bias={40: 6.0, 41: 5.0, 42: -100}),
    ),
    "all": (
        {"top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2}
        | {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"7": 3}},
        SamplingConfig(
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={7: 3.0},
        ),
    ),
}


def complete(client, body, prompt, seed):
    """A completion with the sampler fields of `body` (vLLM's extras via extra_body)."""
    native = {"temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias"}
    kw = {k: v for k, v in body.items() if k in native}
    extra = {k: v for k, v in body.items() if k not in native}
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, seed=seed, extra_body=extra, **kw
    )
    return r.choices[0].text


def test_requests_with_different_samplers_at_once_each_equal_generate(server, client):
    """All samplers at the same time (the Engine batches them into one sampling call)."""
    prompt = server.tokenizer.encode("the cat sat")
    with ThreadPoolExecutor(len(SAMPLERS)) as pool:
        texts = list(pool.map(lambda b: complete(client, b[0], prompt, 11), SAMPLERS.values()))
    for name, text, (_, sampling) in zip(SAMPLERS, texts, SAMPLERS.values()):
        want = reference(server, prompt, 10, sampling, seed=11)
        assert text == server.tokenizer.decode(want), name
    plain = reference(server, prompt, 10, SamplingConfig(temperature=0))
    assert texts[4] != server.tokenizer.decode(plain), "the bias changes the greedy answer"


def test_ignore_eos_and_min_tokens(server, client):
    """A bias of +100 on <eos> makes it every greedy choice: the reply ends after one token;
    with min_tokens=4 after five (<eos> banned until then); with ignore_eos at max_tokens."""
    eos = server.tokenizer.token_id("<eos>")
    prompt = server.tokenizer.encode("hello")
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    sampling = SamplingConfig(temperature=0, logit_bias={eos: 100})
    r = client.completions.create(**kw)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(**kw, extra_body={"min_tokens": 4})
    want = reference(server, prompt, 8, sampling, min_new_tokens=4)
    assert len(want) == 5 and want[-1] == eos
    assert r.choices[0].text == server.tokenizer.decode(want)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (8, "length")


def test_chat_top_logprobs_are_the_models(server, client):
    messages = [{"role": "user", "content": "hello cat"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    tok = server.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages))
    out = reference(server, ids, 5, SamplingConfig(temperature=0), stops=("<eos>", "<|end|>"))
    with torch.no_grad():
        logp = torch.log_softmax(server.model(torch.tensor([ids + out]))[0].float(), -1)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out)
    for i, entry in enumerate(content):
        values, top_ids = logp[len(ids) - 1 + i].topk(3)
        names = [token_text(tok, t) for t in top_ids.tolist()]  # (a partial character: its
        assert [t.token for t in entry.top_logprobs] == names  # vocabulary string)
        got = torch.tensor([t.logprob for t in entry.top_logprobs])
        torch.testing.assert_close(got, values, atol=1e-4, rtol=0)
        assert entry.logprob == pytest.approx(float(logp[len(ids) - 1 + i, out[i]]), abs=1e-4)


def test_logprobs_are_the_raw_distribution_before_logit_bias_and_penalties(server, client):
    """As vLLM's default (logprobs-mode raw_logprobs): a token forced by a bias of +100 is
    reported at the model's own log-probability, not at the biased one (about 0)."""
    tok = server.tokenizer
    prompt, forced = tok.encode("hello"), 40
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        logit_bias={str(forced): 100},
        frequency_penalty=2.0,
    )
    with torch.no_grad():
        logp = torch.log_softmax(server.model(torch.tensor([prompt + [forced] * 2]))[0].float(), -1)
    got = r.choices[0].logprobs
    assert got.tokens == [token_text(tok, forced)] * 3
    for i in range(3):
        want = float(logp[len(prompt) - 1 + i, forced])
        assert want < -1.0  # the bias, not the model, chose it
        assert got.token_logprobs[i] == pytest.approx(want, abs=1e-4)
        values, top_ids = logp[len(prompt) - 1 + i].topk(2)
        top = got.top_logprobs[i]
        assert list(top) == [token_text(tok, t) for t in top_ids.tolist()]
        torch.testing.assert_close(torch.tensor(list(top.values())), values, atol=1e-4, rtol=0)


def test_chat_top_logprobs_without_logprobs_is_a_400(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_chat_stream_include_usage_ends_with_a_usage_chunk(server, client):
    messages = [{"role": "user", "content": "the dog"}]
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    whole = client.chat.completions.create(**kw)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


BAD = {
    "top_k": [-2, 1.5, "3"],
    "min_p": [1.5, -0.1],
    "presence_penalty": [2.5],
    "frequency_penalty": [-3],
    "repetition_penalty": [0, -1],
    "logit_bias": [{"x": 1}, {"999999": 1}, {"5": 101}, {"5": "a"}, [1, 2]],
    "min_tokens": [-1, 50],
    "ignore_eos": ["yes"],
}
CASES = [(name, value) for name, values in BAD.items() for value in values]


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}={v!r}" for n, v in CASES])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_sampler_values_are_a_400_naming_the_field(server, client, name, value, route):
    extra = {name: value}
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, extra_body=extra
            )
        else:
            client.completions.create(model="tiny", prompt="a", max_tokens=8, extra_body=extra)
    assert e.value.body["param"] == name and name in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


def test_neutral_values_change_nothing(server, client):
    neutral = dict(logit_bias={}, frequency_penalty=0, presence_penalty=0, top_k=-1, min_p=0)
    neutral |= dict(ignore_eos=False, min_tokens=0, repetition_penalty=1)
    kw = dict(model="tiny", prompt="the cat", max_tokens=6, temperature=0)
    r = client.completions.create(**kw, extra_body=neutral | {"top_k": 0})
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text
