"""Serve a decoder checkpoint over an OpenAI-compatible HTTP API (attnlab.serve.app).

    attnlab serve --ckpt runs/default                       # http://127.0.0.1:8000/v1
    attnlab serve --ckpt gpt2-hf --port 8080 --api-key s3cret --engine sequential

Any checkpoint `open_checkpoint` reads that holds a decoder-only LM (trained, converted from HF,
quantized; a LoRA fine-tuning run, its adapters merged) with its
tokenizer.json. `--engine batched` (continuous batching over a paged KV cache) is the default;
`sequential` runs one request at a time. SIGTERM or Ctrl-C stops admitting, lets running
requests finish for up to --stop-timeout seconds, then exits.

    attnlab serve --ckpt runs/default --steer 3 ' love' ' hate' 4

`--steer` (the syntax of `attnlab generate --steer`, inference/steering.py) steers every
request: the vectors are added to the residual stream for the server's whole life, on both
engines, so a served greedy completion is `attnlab generate`'s with the same steering.

`--speculative ngram|draft` (inference/speculative.py) decodes one request at a time (batch 1):
it runs the sequential engine, and /metrics gains the acceptance rate and tokens/s.
"""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from attnlab.accel.fast_linear import enable_fast_linear
from attnlab.accel.host_memory import keep_freed_memory
from attnlab.checkpoint import Loaded, open_checkpoint
from attnlab.cli.options import add_speculative_flags, add_steer_flag, speculative_from_args
from attnlab.inference.steering import steering, text_steers
from attnlab.inference.steps import decoder_of, prefix_length
from attnlab.models.heads import task_head_kind
from attnlab.serve.app import bind, create_app, run_server
from attnlab.serve.protocol import Settings
from attnlab.serve.sequential import SequentialEngine, context_length
from attnlab.serve.types import DEFAULT_ENGINE, EngineConfig

ENGINE_DEFAULTS = DEFAULT_ENGINE
SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}
API_KEY_ENV = "ATTNLAB_API_KEY"


def port_number(text: str) -> int:
    """--port's value: an int in [0, 65535] (argparse prints the message on one line)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: choose one in [0, 65535]")
    return port


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="DIR", help="a decoder checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="port (default %(default)s; 0: any free)"
    )
    p.add_argument(
        "--engine",
        choices=("batched", "sequential"),
        default="batched",
        help="continuous batching, or one request at a time (default %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=ENGINE_DEFAULTS.max_batch,
        metavar="N",
        help="requests decoded together (batched engine; default %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=ENGINE_DEFAULTS.max_queue,
        metavar="N",
        help="requests that may wait; more get HTTP 429 (default %(default)s)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        metavar="N",
        help="prompt + new tokens per request (default: the model's max_seq_len)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV),
        help=f"require Authorization: Bearer KEY on /v1 (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model id clients send (default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=SETTINGS_DEFAULTS["stop_timeout"],
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default %(default)s)")
    add_steer_flag(p)
    add_speculative_flags(p)
    p.add_argument(
        "--compile-attention",
        action="store_true",
        help="batched engine: decode steps attend through a compiled kernel that reads the KV "
        "pool in place (compiled at start, needs a C compiler; accel/paged_attention.py)",
    )
    p.add_argument(
        "--fast-linear",
        action="store_true",
        help="on CPU, fp32 Linear layers through oneDNN instead of the default BLAS "
        "(accel/fast_linear.py)",
    )
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="on CPU, have glibc keep freed memory in the process: a batched decode step's "
        "large temporaries then reuse memory instead of page-faulting fresh pages every step "
        "(the process keeps its peak memory; accel/host_memory.py)",
    )


def engine_class(name: str):
    """The engine class for --engine (the batched one if this build has it)."""
    if name == "sequential":
        return SequentialEngine
    try:
        from attnlab.serve.engine import Engine
    except ModuleNotFoundError:
        print(
            "attnlab serve: no batched engine in this build; running --engine sequential",
            file=sys.stderr,
        )
        return SequentialEngine
    return Engine


def run(args: argparse.Namespace) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.keep_freed_memory and torch.device(device).type == "cpu":
        keep_freed_memory()  # for the whole process, from here on
    Engine = engine_class(args.engine)
    if args.speculative is not None and Engine is not SequentialEngine:
        print(
            "attnlab serve: --speculative decodes one request at a time (batch 1): running "
            "--engine sequential",
            file=sys.stderr,
        )
        Engine = SequentialEngine
    threads = torch.get_num_threads()
    if Engine is not SequentialEngine:
        # The engine's thread gets the threads; this one (loading, then the HTTP event loop)
        # keeps to one, so that the engine's OpenMP team is the only one (engine.py, "Threads").
        torch.set_num_threads(1)
    loaded = open_served(args.ckpt, device)
    model, tokenizer = loaded.model, loaded.tokenizer
    with steering(model, text_steers(model, tokenizer, args.steer)):  # every request, if any
        return serve(args, loaded, Engine, threads, device)


def serve(args: argparse.Namespace, loaded: Loaded, Engine, threads: int, device: str) -> int:
    """Start the engine on the opened checkpoint and serve until stopped."""
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.fast_linear and torch.device(device).type == "cpu":
        enable_fast_linear(model)
    max_context = args.max_context or loaded.config.max_seq_len
    context = context_length(model, max_context)
    options = EngineConfig(args.max_batch, max_queue=args.max_queue, max_context=context)
    if Engine is SequentialEngine:
        if args.compile_attention:
            raise ValueError("--compile-attention is for the batched engine (--engine batched)")
        engine = Engine(model, tokenizer, options, speculative_from_args(args, device, tokenizer))
    else:
        options = dataclasses.replace(
            options, threads=threads, compile_attention=args.compile_attention
        )
        engine = Engine(model, tokenizer, options)
        try:
            engine.start()  # prepared (compiled) before the port opens; the app's start: no-op
        except RuntimeError as err:
            if not args.compile_attention:
                raise
            raise ValueError(f"{err}: serve without --compile-attention") from err
    name = args.model_name or Path(args.ckpt).resolve().name
    settings = Settings(name, context, model_vocab(model), args.api_key, args.stop_timeout)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"attnlab serve: {name} on http://{host}:{port}/v1 ({Engine.__name__})", flush=True)
    run_server(create_app(engine, tokenizer, settings), sock, args.stop_timeout)
    print("attnlab serve: stopped", flush=True)
    return 0


def open_served(ckpt: str, device: str = "cpu") -> Loaded:
    """The checkpoint `attnlab serve --ckpt` serves (any kind `open_checkpoint` reads; a LoRA
    run's adapters merged), checked: a decoder-only LM with an LM head and a tokenizer."""
    loaded = open_checkpoint(ckpt, device)
    model = loaded.model
    if loaded.config.arch != "decoder" or hasattr(model, "encode") or prefix_length(model):
        raise ValueError(
            f"{ckpt!r} holds a {loaded.config.arch} model; attnlab serve needs a decoder-only "
            "language model checkpoint"
        )
    if (kind := task_head_kind(loaded.config)) is not None:
        raise ValueError(f"{ckpt!r} is {kind}: it has no LM head to serve")
    if loaded.tokenizer is None:
        raise ValueError(f"{ckpt!r} has no tokenizer.json: attnlab serve needs one")
    return loaded


def model_vocab(model: torch.nn.Module) -> int:
    """The size of the model's output vocabulary."""
    return decoder_of(model).head.out_features
