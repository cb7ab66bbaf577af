"""`attnlab serve --speculative`: the sequential engine decoding by draft and verify gives plain
decoding's tokens and log-probabilities, and /metrics reports its acceptance and tokens/s."""

import socket

import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.__main__ import main
from attnlab.inference.speculative import ModelDrafter, NgramDrafter, Speculative
from attnlab.serve.protocol import prometheus_text
from attnlab.serve.sequential import SequentialEngine
from attnlab.serve.types import EngineConfig, Request, SamplingParams
from tests.serve.server_helpers import write_checkpoint
from tests.serve.test_server_sequential import Collector


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")


def run(loaded, speculative, prompts, params):
    engine = SequentialEngine(
        loaded.model, loaded.tokenizer, EngineConfig(max_context=128), speculative
    )
    out = Collector()
    engine.start()
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", tuple(p), params), out)
    out.wait(len(prompts))
    engine.stop(5)
    return out, engine.stats()


def test_speculative_engine_sends_plain_decodings_tokens_and_logprobs(ckpt):
    loaded = open_checkpoint(ckpt)
    torch.set_num_threads(1)
    prompts = [[5, 6, 7, 5, 6], list(range(10, 40))]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    plain, _ = run(loaded, None, prompts, params)
    drafter = ModelDrafter(open_checkpoint(ckpt).model)  # the model itself: all accepted
    spec, stats = run(loaded, Speculative(drafter, 3), prompts, params)
    for i in range(len(prompts)):
        assert spec.tokens(f"r{i}") == plain.tokens(f"r{i}")
        for a, b in zip(spec.events[f"r{i}"], plain.events[f"r{i}"]):
            assert a.finish_reason == b.finish_reason
            if a.token_id is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert a.top_logprobs.keys() == b.top_logprobs.keys()
    assert stats["speculative_accepted_tokens_total"] == stats["speculative_draft_tokens_total"]
    assert stats["generation_tokens_total"] == 24
    text = prometheus_text(stats, {})
    assert "# TYPE attnlab_speculative_acceptance_rate gauge" in text
    assert "attnlab_speculative_acceptance_rate 1.0" in text
    assert "# TYPE attnlab_speculative_draft_tokens_total counter" in text
    assert "attnlab_speculative_tokens_per_second" in text


def test_speculative_stops_at_a_stop_token(ckpt):
    loaded = open_checkpoint(ckpt)
    params = SamplingParams(max_tokens=12, temperature=0)
    plain, _ = run(loaded, None, [[5, 6, 7]], params)
    stop = plain.tokens("r0")[4]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,))
    spec, _ = run(loaded, Speculative(NgramDrafter(), 4), [[5, 6, 7]], params)
    want = plain.tokens("r0")[: plain.tokens("r0").index(stop) + 1]
    assert spec.tokens("r0") == want and spec.events["r0"][-1].finish_reason == "stop"


@pytest.mark.slow  # loads the checkpoint through the CLI (0.5 s)
def test_serve_speculative_falls_back_to_the_sequential_engine(ckpt, capsys):
    with socket.socket() as taken:  # the server stops at the port, after building its engine
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--ckpt", str(ckpt), "--port", str(port), "--speculative", "ngram"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0] == (
        "attnlab serve: --speculative decodes one request at a time (batch 1): running "
        "--engine sequential"
    )
    assert "is in use" in err[1]


def test_draft_flags_without_speculative_draft_are_one_line(ckpt, capsys):
    args = ["serve", "--ckpt", str(ckpt), "--draft-quantize", "int4", "--engine", "sequential"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "attnlab serve: error: --draft-ckpt and --draft-quantize need --speculative draft"
    ]
