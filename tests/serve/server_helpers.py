"""A tiny served model for the server tests: a checkpoint written by the test, and the real
uvicorn server on a free loopback port in a thread."""

import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.cli.serve import add_served_adapters
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import llama_tiny
from attnlab.serve.app import bind, create_app
from attnlab.serve.protocol import Settings
from attnlab.serve.sequential import SequentialEngine
from attnlab.serve.types import EngineConfig
from attnlab.tokenizer import CHAT_TOKENS, train_bpe_tokenizer

TEXT = "the cat sat on the mat. the dog ate the bone. hello world, hello cat. " * 8


def engines() -> list:
    """The engines to serve with: the sequential one, and the batched one where it exists."""
    try:
        from attnlab.serve.engine import Engine
    except ModuleNotFoundError:
        return [SequentialEngine]
    return [SequentialEngine, Engine]


def write_checkpoint(path: Path, max_seq_len: int | None = None) -> Path:
    """A random llama_tiny (GQA, RoPE) with a byte-level BPE tokenizer that has chat markers
    (and a context of `max_seq_len` tokens where given)."""
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer([TEXT], 320, CHAT_TOKENS)
    config = replace(llama_tiny(), vocab_size=tokenizer.vocab_size)
    config = replace(config, max_seq_len=max_seq_len or config.max_seq_len)
    return save_pretrained(path, build_model(config).eval(), config, tokenizer)


class SlowEngine(SequentialEngine):
    """A SequentialEngine that takes DELAY s (10 ms) per token and ignores <eos>: a request of
    100 tokens lasts over a second."""

    DELAY = 0.01

    def _run(self, request, on_event, arrived):
        def slow(event):
            time.sleep(self.DELAY)
            on_event(event)

        request = replace(request, params=replace(request.params, stop_token_ids=()))
        return super()._run(request, slow, arrived)


class Server:
    """The app on 127.0.0.1:<free port> in a thread (uvicorn), until `close()`."""

    def __init__(
        self,
        ckpt: Path,
        engine_cls=SequentialEngine,
        api_key=None,
        model_name="tiny",
        lora=(),
        ui=True,
        **engine_kw,
    ):
        import uvicorn

        loaded = open_checkpoint(ckpt)
        self.model, self.tokenizer, self.config = loaded.model, loaded.tokenizer, loaded.config
        adapters = add_served_adapters(self.model, self.config, list(lora), model_name)  # NAME=DIR
        context = loaded.config.max_seq_len
        self.engine = engine_cls(
            self.model, self.tokenizer, EngineConfig(max_context=context, **engine_kw)
        )
        settings = Settings(
            model_name,
            context,
            loaded.config.vocab_size,
            api_key,
            stop_timeout=5,
            adapters=adapters,
            ui=ui,
        )
        self.app = create_app(self.engine, self.tokenizer, settings)
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def reference(
    server,
    ids,
    n,
    sampling=None,
    seed=None,
    stops=("<eos>",),
    min_new_tokens=0,
) -> list[int]:
    """attnlab's own generation for one prompt (greedy unless `sampling` says otherwise): the
    tokens the server must return."""
    sampling = SamplingConfig(temperature=0) if sampling is None else sampling
    stop_ids = [i for i in map(server.tokenizer.token_id, stops) if i is not None]
    config = GenerationConfig(
        n, sampling, stop_tokens=stop_ids, seed=seed, min_new_tokens=min_new_tokens
    )
    return generate(server.model, [ids], config)[0]
