"""Serve a decoder checkpoint over an OpenAI-compatible HTTP API (attnlab.serve.app).

    attnlab serve --ckpt runs/default                       # http://127.0.0.1:8000/v1
    attnlab serve --ckpt gpt2-hf --port 8080 --api-key s3cret --engine sequential
    attnlab serve --ckpt gpt2-hf --lora sql=adapters/sql --lora chat=adapters/chat

http://127.0.0.1:8000/ is a chat page over the API (serve/static/chat.html; `--no-ui`: none).

Any checkpoint `open_checkpoint` reads that holds a decoder-only LM (trained, converted from HF,
quantized; a LoRA fine-tuning run, its adapters merged) with its
tokenizer.json. `--engine batched` (continuous batching over a paged KV cache) is the default;
`sequential` runs one request at a time. `--lora NAME=DIR` (repeatable) serves a LoRA adapter in
the PEFT format (`interop.peft.save_peft`'s or peft's), or an `attnlab finetune
--lora.rank R` run on the same base (its directory, read at its latest checkpoint as --ckpt
is, or one checkpoint of it), beside the base, listed in
/v1/models with the base as its parent; a request picks it by `model`, as vLLM's do, and
requests for different adapters share one batched decode step (adapters/multi_lora.py).
A chat completion's sampler fields left out take the checkpoint's own defaults, else llama.cpp's
(inference.sampling.chat_sampling); a completion's, OpenAI's.
SIGTERM or Ctrl-C stops admitting, lets running requests finish for up to --stop-timeout
seconds, then exits.

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
import re
import sys
from pathlib import Path

import torch

from attnlab.accel.fast_linear import enable_fast_linear
from attnlab.accel.host_memory import keep_freed_memory, share_one_malloc_arena
from attnlab.adapters.config import LoraConfig
from attnlab.adapters.lora import lora_modules
from attnlab.adapters.multi_lora import add_multi_lora
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.checkpoint import CONFIG, Loaded, open_checkpoint, resolve_checkpoint
from attnlab.cli.kinds import require
from attnlab.cli.options import (
    add_ckpt_flag,
    add_kv_cache_dtype_flag,
    add_speculative_flags,
    add_steer_flags,
    kv_cache_dtype_from_args,
    speculative_from_args,
    steers_from_args,
)
from attnlab.configs import from_dict
from attnlab.inference.sampling import CHAT_SAMPLING, chat_sampling, describe
from attnlab.inference.steering import steering
from attnlab.inference.steps import decoder_of, prefix_length
from attnlab.interop.peft import CONFIG as PEFT_CONFIG
from attnlab.interop.peft import read_adapters
from attnlab.models.config import ModelConfig
from attnlab.serve.app import bind, create_app, run_server
from attnlab.serve.protocol import Settings
from attnlab.serve.sequential import SequentialEngine, context_length
from attnlab.serve.types import DEFAULT_ENGINE, EngineConfig, available_memory

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


UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
}


SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*|%)\s*")


def memory_size(text: str) -> str:
    """--kv-cache-memory's value, checked: a size (512MiB, 2G, 1.5GB) or a share (25%)."""
    match = SIZE.fullmatch(text)
    number, unit = (float(match[1]), match[2].lower()) if match else (0.0, "?")
    if unit == "%":
        ok = 0 < number <= 100
    else:
        ok = unit in UNITS and number * UNITS[unit] >= 1
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: give bytes with a unit (512MiB, 2G) or a share "
            "of the available memory (25%)"
        )
    return text


def kv_memory_bytes(size: str | None, device: torch.device) -> int | None:
    """--kv-cache-memory in bytes (None: the engine's default); a share of the memory
    available now, for N%."""
    if size is None:
        return None
    match = SIZE.fullmatch(size)
    number, unit = float(match[1]), match[2].lower()
    if unit == "%":
        available = available_memory(device)
        if available is None:
            raise ValueError(
                f"--kv-cache-memory {size}: this machine does not say how much memory is "
                "available; give a size (e.g. 1GiB)"
            )
        return int(number / 100 * available)
    return int(number * UNITS[unit])


def add_parser(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "the decoder to serve")
    p.epilog = (
        "A chat completion samples each field it leaves out at the checkpoint's own defaults "
        "(an HF generation_config.json that samples, a GGUF's general.sampling.*), else at "
        f"llama.cpp's ({describe(CHAT_SAMPLING)}); a completion at OpenAI's (temperature 1)."
    )
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
        "--kv-cache-memory",
        type=memory_size,
        metavar="SIZE",
        help="memory of the batched engine's KV pool, shared by all requests: bytes with a "
        "unit (512MiB, 2G) or a share of the memory available at start (25%%); when it is "
        "full the newest request is paused and recomputed later (default: 1GiB or 10%%, "
        "the smaller)",
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
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve a LoRA adapter for this base (a PEFT directory, or an attnlab finetune "
        "--lora.rank run: its directory, read at its latest checkpoint, or one checkpoint) as "
        "model NAME; repeatable",
    )
    p.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the chat page at / (the /v1 API is the same either way)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=SETTINGS_DEFAULTS["stop_timeout"],
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default %(default)s)")
    add_steer_flags(p)
    add_kv_cache_dtype_flag(p)
    add_speculative_flags(p)
    p.add_argument(
        "--compile-attention",
        action="store_true",
        help="batched engine: decode steps attend through a compiled kernel that reads the KV "
        "pool in place (compiled at start, needs a C compiler; accel/paged_attention.py)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="batched engine: each decode step runs as one compiled graph of the whole model "
        "over the KV pool (accel/paged_step.py): faster per token, after compiling at start "
        "(minutes the first time; needs a C compiler); not with --lora or --kv-cache-dtype",
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
    share_one_malloc_arena()  # the server's threads reuse each other's freed memory
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
    steers = steers_from_args(model, tokenizer, args)
    with steering(model, steers):  # every request, if any
        return serve(args, loaded, Engine, threads, device)


def serve(args: argparse.Namespace, loaded: Loaded, Engine, threads: int, device: str) -> int:
    """Start the engine on the opened checkpoint (with its --lora adapters) and serve until
    stopped."""
    model, tokenizer = loaded.model, loaded.tokenizer
    name = args.model_name or Path(args.ckpt).resolve().name
    if args.lora and isinstance(model, PromptLearningLM):
        raise ValueError(
            "--lora adapters go on a plain base, not on a prefix- or prompt-tuning run"
        )
    adapters = add_served_adapters(model, loaded.config, args.lora, name)
    if args.fast_linear and torch.device(device).type == "cpu":
        enable_fast_linear(model)
    max_context = args.max_context or loaded.config.max_seq_len
    context = context_length(model, max_context)
    options = EngineConfig(
        args.max_batch,
        max_queue=args.max_queue,
        max_context=context,
        kv_cache_dtype=kv_cache_dtype_from_args(args),
    )
    if Engine is SequentialEngine:
        for flag in ("compile_attention", "compile"):
            if getattr(args, flag):
                name = "--" + flag.replace("_", "-")
                raise ValueError(f"{name} is for the batched engine (--engine batched)")
        engine = Engine(model, tokenizer, options, speculative_from_args(args, device, tokenizer))
    else:
        options = dataclasses.replace(
            options,
            threads=threads,
            compile_attention=args.compile_attention,
            compile_decode=args.compile,
            kv_cache_memory=kv_memory_bytes(args.kv_cache_memory, torch.device(device)),
        )
        engine = Engine(model, tokenizer, options)
        flags = {"--compile-attention": args.compile_attention, "--compile": args.compile}
        compiled = [flag for flag, on in flags.items() if on]
        if args.compile:
            print(
                "attnlab serve: compiling the decode step (the first time for this model here: "
                "minutes; later starts read torch inductor's disk cache)",
                file=sys.stderr,
            )
        try:
            engine.start()  # prepared (compiled) before the port opens; the app's start: no-op
        except RuntimeError as err:
            if not compiled:
                raise
            raise ValueError(f"{err}: serve without {' '.join(compiled)}") from err
    settings = Settings(
        name,
        context,
        model_vocab(model),
        args.api_key,
        args.stop_timeout,
        adapters=adapters,
        ui=args.ui,
        chat_sampling=chat_sampling(loaded.sampling),
    )
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    served = "".join(f", {a}" for a in adapters)
    page = f"; chat page at http://{host}:{port}/" if args.ui else ""
    print(
        f"attnlab serve: {name}{served} on http://{host}:{port}/v1 ({Engine.__name__}){page}",
        flush=True,
    )
    if Engine is not SequentialEngine:
        print(f"attnlab serve: {pool_line(engine.cache, context)}", flush=True)
    run_server(create_app(engine, tokenizer, settings), sock, args.stop_timeout)
    print("attnlab serve: stopped", flush=True)
    return 0


def pool_line(cache, context: int) -> str:
    """What the KV pool holds, in tokens, bytes and full-length requests."""
    full = cache.capacity / context
    return (
        f"KV pool of {cache.capacity:,} tokens ({cache.nbytes / 2**20:,.0f} MiB, "
        f"{cache.dtype}, taken as used): {full:.1f} requests of the full "
        f"{context:,}-token context at once, more when shorter; when it is full the newest "
        "request waits and is recomputed (--kv-cache-memory)"
    )


def open_served(ckpt: str, device: str = "cpu") -> Loaded:
    """The checkpoint `attnlab serve --ckpt` serves (any kind `open_checkpoint` reads; a LoRA
    run's adapters merged; a prefix- or prompt-tuning run, whose prefix both engines write
    first into each request's cache), checked: a decoder-only LM with an LM head and a
    tokenizer."""
    loaded = open_checkpoint(ckpt, device)
    model = loaded.model
    image = prefix_length(model) and not isinstance(model, PromptLearningLM)
    require(ckpt, loaded, "attnlab serve", ("decoder",), "a decoder-only LM")
    if image:
        raise ValueError(f"{ckpt!r} reads images: attnlab serve needs a text-only decoder LM")
    if loaded.tokenizer is None:
        raise ValueError(f"{ckpt!r} has no tokenizer.json: attnlab serve needs one")
    return loaded


def add_served_adapters(
    model: torch.nn.Module, cfg: ModelConfig, specs: list[str], base_name: str
) -> dict[str, str]:
    """Read every --lora NAME=DIR (`adapter_weights`; a run directory is resolved to its latest
    checkpoint, as --ckpt is) and put them all on `model` as MultiLoRALinear stacks, adapter
    i + 1 the i-th named. Returns {NAME: the directory read}.

    Raises:
        ValueError naming the flag for a malformed or repeated NAME, a directory that is no
        LoRA adapter, or an adapter for another base model.
    """
    served: dict[str, str] = {}
    stacks = []
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora {spec!r}: give NAME=DIR, e.g. --lora sql=adapters/sql")
        if name == base_name or name in served:
            raise ValueError(f"--lora {spec!r}: the model id {name!r} is already served")
        try:
            path = resolve_checkpoint(path)  # a run directory: its latest checkpoint, as --ckpt
            stacks.append(adapter_weights(model, cfg, path))
        except (ValueError, OSError) as e:
            raise ValueError(f"--lora {spec!r}: {e}") from None
        served[name] = str(path.resolve())
    if stacks:
        add_multi_lora(model, stacks)
    return served


def adapter_weights(model: torch.nn.Module, cfg: ModelConfig, path: Path) -> dict[str, tuple]:
    """{our Linear's name: (A, B, scale)} of the LoRA adapter in `path`: a PEFT directory, or
    a checkpoint of an `attnlab finetune --lora.rank R` run on this very base (its config and
    weights; `add_served_adapters` resolves a run directory to it). Either must train A and B
    alone: biases or whole modules trained beside them would change the base for every
    request."""
    if (path / PEFT_CONFIG).is_file():
        _, found, others = read_adapters(model, cfg, path)
        if others:
            raise ValueError(f"the adapter trains {sorted(others)[0]} beside A and B")
        return {n: (a.A, a.B, a.scale) for n, a in found.items()}
    if not (path / CONFIG).is_file():
        raise ValueError(
            f"{str(path)!r} is no LoRA adapter (no {PEFT_CONFIG} nor {CONFIG}): give a peft "
            "adapter directory, or an attnlab finetune --lora.rank R run directory or one of "
            "its checkpoints"
        )
    run = open_checkpoint(path, keep_adapters=True)
    adapters = lora_modules(run.model)
    if not adapters:
        raise ValueError(f"{str(path)!r} holds no LoRA adapters (nor an adapter_config.json)")
    ours = dict(model.named_parameters())
    base = {
        k.replace(".base.", "."): p for k, p in run.model.named_parameters() if "lora_" not in k
    }
    if run.config != cfg or any(not torch.equal(p, ours[k]) for k, p in base.items() if k in ours):
        raise ValueError(f"{str(path)!r} was trained on another base model than --ckpt's")
    if from_dict(LoraConfig, run.run["lora"]).trains_base:
        raise ValueError(f"{str(path)!r} trains biases or modules beside A and B")
    return {n: (m.lora_A.detach(), m.lora_B.detach(), m.scale) for n, m in adapters.items()}


def model_vocab(model: torch.nn.Module) -> int:
    """The size of the model's output vocabulary."""
    return decoder_of(model).head.out_features
