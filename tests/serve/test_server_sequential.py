"""SequentialEngine, the serving interface run one request at a time: its tokens are
`generate`'s, each request ends with exactly one final event, and stop/cancel/queue bounds
behave as types.py says."""

import threading

import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.serve.sequential import SequentialEngine
from attnlab.serve.types import EngineConfig, EngineStopped, QueueFull, Request, SamplingParams
from tests.serve.server_helpers import write_checkpoint


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return open_checkpoint(write_checkpoint(tmp_path_factory.mktemp("seq") / "tiny"))


class Collector:
    """on_event for many requests: events per request id, and which requests have finished."""

    def __init__(self):
        self.events, self.lock = {}, threading.Lock()
        self.finished = threading.Semaphore(0)

    def __call__(self, event):
        with self.lock:
            self.events.setdefault(event.request_id, []).append(event)
        if event.finish_reason is not None:
            self.finished.release()

    def wait(self, n: int, timeout: float = 60) -> None:
        for _ in range(n):
            assert self.finished.acquire(timeout=timeout), "a request never finished"

    def tokens(self, rid: str) -> list[int]:
        return [e.token_id for e in self.events[rid] if e.token_id is not None]


def engine(loaded, **kw) -> SequentialEngine:
    return SequentialEngine(loaded.model, loaded.tokenizer, EngineConfig(max_context=128, **kw))


def test_tokens_are_generates_greedy_and_seeded(loaded):
    e, out = engine(loaded), Collector()
    e.start()
    prompts = [[5, 6, 7], [40, 41], list(range(10, 40))]
    for i, p in enumerate(prompts):
        e.submit(Request(f"g{i}", tuple(p), SamplingParams(max_tokens=9, temperature=0)), out)
        e.submit(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=9, seed=i)), out)
    out.wait(2 * len(prompts))
    e.stop(5)
    for i, p in enumerate(prompts):
        assert (
            out.tokens(f"g{i}")
            == generate(loaded.model, [p], GenerationConfig(9, SamplingConfig(temperature=0)))[0]
        )
        seeded = generate(loaded.model, [p], GenerationConfig(9, SamplingConfig(), seed=i))[0]
        assert out.tokens(f"s{i}") == seeded
        for rid in (f"g{i}", f"s{i}"):
            reasons = [ev.finish_reason for ev in out.events[rid]]
            assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == "length"


def test_prompt_logprobs_only(loaded):
    e, out = engine(loaded), Collector()
    e.start()
    ids = [3, 50, 60, 70]
    e.submit(Request("p", tuple(ids), SamplingParams(max_tokens=0, prompt_logprobs=True)), out)
    out.wait(1)
    e.stop(5)
    (event,) = out.events["p"]
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(torch.tensor([ids]))[0, :-1].float(), dim=-1)
    expected = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert event.prompt_logprobs[0] is None and event.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(event.prompt_logprobs[1:]), expected)


def test_queue_bound_cancel_and_stop(loaded):
    e, out = engine(loaded, max_queue=2), Collector()  # not started: requests wait
    long = SamplingParams(max_tokens=100, temperature=0)
    e.submit(Request("a", (5,), long), out)
    e.submit(Request("b", (6,), long), out)
    with pytest.raises(QueueFull):
        e.submit(Request("c", (7,), long), out)
    e.cancel("b")
    assert [ev.finish_reason for ev in out.events["b"]] == ["cancelled"]
    assert e.stats()["waiting"] == 1
    e.start()
    e.stop(60)  # "a" runs to its end within the timeout
    assert out.events["a"][-1].finish_reason == "length" and len(out.tokens("a")) == 100
    with pytest.raises(EngineStopped):
        e.submit(Request("d", (8,), long), out)


def test_stop_cancels_what_the_timeout_leaves(loaded):
    e, out = engine(loaded), Collector()
    for i in range(3):
        e.submit(Request(f"r{i}", (5 + i,), SamplingParams(max_tokens=120)), out)
    e.start()
    e.stop(0)
    out.wait(3, timeout=5)
    for i in range(3):
        reasons = [ev.finish_reason for ev in out.events[f"r{i}"] if ev.finish_reason]
        assert len(reasons) == 1  # exactly one final event each
    assert out.events["r2"][-1].finish_reason == "cancelled"
    assert e.stats()["running"] == e.stats()["waiting"] == 0


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ((), SamplingParams(), "empty"),
        ((5, 10**6), SamplingParams(), "outside the vocabulary"),
        ((5,) * 100, SamplingParams(max_tokens=29), "exceeds the model's context of 128"),
        ((5,), SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        ((5,), SamplingParams(temperature=-1), "temperature"),
        ((5,), SamplingParams(top_p=0), "top_p"),
    ],
)
def test_bad_requests_are_one_line_value_errors(loaded, prompt, params, match):
    with pytest.raises(ValueError, match=match) as e:
        engine(loaded).submit(Request("x", prompt, params), lambda ev: None)
    assert "\n" not in str(e.value)
