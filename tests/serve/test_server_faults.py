"""Faults at the server: clients that hang up (streaming or not) free their requests, and a
request that fails inside the engine is an error for that client only."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from attnlab.serve.sequential import SequentialEngine
from tests.serve.server_helpers import Server, SlowEngine, write_checkpoint

BOOM = 5  # a prompt starting with this token id fails inside the engine


class FaultyEngine(SequentialEngine):
    """A SequentialEngine whose requests fail when their prompt starts with BOOM."""

    def _run(self, request, on_event, arrived):
        if request.prompt_ids[0] == BOOM:
            raise RuntimeError("planted fault")
        return super()._run(request, on_event, arrived)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "tiny")


def spy_cancels(server: Server) -> list[str]:
    cancelled, cancel = [], server.engine.cancel
    server.engine.cancel = lambda rid: (cancelled.append(rid), cancel(rid))
    return cancelled


def eventually(condition, timeout: float = 20, message=lambda: "") -> None:
    """Wait until condition() holds (the server notices a hang-up within its poll interval)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"the condition never held: {message()}"
        time.sleep(0.05)


def idle(server: Server) -> bool:
    stats = server.engine.stats()
    return not stats["running"] and not stats["waiting"]


def test_a_client_gone_mid_stream_frees_its_request(ckpt):
    s = Server(ckpt, SlowEngine)
    cancelled = spy_cancels(s)
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 120, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            rid = json.loads(first[6:])["id"]
        eventually(lambda: cancelled and idle(s))
        assert set(cancelled) == {f"{rid}-0"}
        assert s.engine.stats()["generation_tokens_total"] < 120
        assert s.engine.stats()["requests_finished_total"] == 1
    finally:
        s.close()


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_client_gone_before_a_plain_answer_frees_its_request(ckpt):
    s = Server(ckpt, SlowEngine)
    cancelled = spy_cancels(s)
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 100, "n": 4}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=0.3)
        eventually(lambda: len(cancelled) == 4 and idle(s))  # the running one and the waiting
        assert s.engine.stats()["generation_tokens_total"] < 100
    finally:
        s.close()


def test_a_failing_request_is_a_500_and_the_server_keeps_serving(ckpt):
    s = Server(ckpt, FaultyEngine)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="planted fault") as e:
            client.completions.create(model="tiny", prompt=[BOOM, 6], max_tokens=3)
        assert e.value.status_code == 500 and e.value.body["code"] == "engine_error"
        with pytest.raises(openai.APIError, match="planted fault"):
            list(client.completions.create(model="tiny", prompt=[BOOM], max_tokens=3, stream=True))
        assert client.completions.create(model="tiny", prompt=[6, 5], max_tokens=3).choices
    finally:
        s.close()


@pytest.mark.slow
def test_overload_is_429_for_some_and_answers_for_the_rest(ckpt):
    s = Server(ckpt, SlowEngine, max_queue=2)  # one running + two waiting; the rest are refused
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 60}  # 0.6 s or more each

        def post(_):
            return httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 429} and codes.count(200) >= 3, codes
        for r in answers:
            if r.status_code == 429:
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 60
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.close()
