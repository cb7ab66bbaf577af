"""What a quantized KV cache (--kv-cache-dtype int8 / fp8) costs in quality and saves in memory,
on SmolLM2-135M-Instruct (no timing).

    .venv/bin/python benchmarks/kv_cache_dtype.py [--gguf FILE] [--tokens 6144] [--context 2048]

Perplexity: text nobody here wrote (Python standard library sources, the modules in STDLIB, as
many tokens as --tokens), cut into windows of --context tokens; each window is prefilled through
a cache of the dtype, so every token is predicted from keys and values read back from that
cache (quantized, for int8 and fp8, its own ones included). Greedy tokens: the chat prompts of
docs/smollm2.md through the chat template, 64 new tokens, against the fp32 (auto) cache. Memory:
bytes per token of the pool, and what serve's default pool budget (1 GiB) then holds.
"""

import argparse
import inspect
import math
import sys
from pathlib import Path

import torch
from _timing import cpu_name

from attnlab.checkpoint import open_checkpoint
from attnlab.components.kv_cache import ModelCache, kv_cache_dtype
from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.finetune.sequences import ChatFormat
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import prefill
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path
from attnlab.serve.types import KV_MEMORY
from attnlab.training.objectives import clm_loss

STDLIB = ("textwrap", "difflib", "fractions", "heapq", "bisect", "calendar", "shlex", "glob")
CHATS = (
    "What is the capital of France?",
    "And what is it famous for?",
    "Write a haiku about the sea.",
)
DTYPES = ("auto", "int8", "fp8")


def stdlib_text() -> str:
    """The sources of STDLIB's modules, one after the other."""
    modules = [__import__(name) for name in STDLIB]
    return "\n\n".join(Path(inspect.getsourcefile(m)).read_text() for m in modules)


@torch.no_grad()
def cached_perplexity(model, ids: list[int], context: int, dtype) -> float:
    """exp(mean cross-entropy) of each window's next tokens, attending through a `dtype` cache."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = torch.tensor([ids[start : start + context + 1]])
        x, y = window[:, :-1], window[:, 1:]
        cache = ModelCache.for_decoder(model, torch.ones_like(x, dtype=bool), dtype=dtype)
        logits = prefill(model, x, cache)  # (1, T, V)
        total += clm_loss(logits.float(), y, reduction="sum").item()
        count += y.numel()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (default: attnlab's cache)")
    parser.add_argument("--tokens", type=int, default=6144, help="text tokens (default 6144)")
    parser.add_argument("--context", type=int, default=2048, help="window (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    path = args.gguf or packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path} is not there: attnlab download smollm2-135m-instruct")
    loaded = open_checkpoint(path)
    model, tok = loaded.model.eval(), loaded.tokenizer
    isa = torch.backends.cpu.get_cpu_capability()
    head = f"{path.name} (fp32 weights), torch {torch.__version__} ({isa}), {cpu_name()}"
    print(f"# kv_cache_dtype.py: {head}")
    ids = tok.encode(stdlib_text())[: args.tokens]
    print(f"# text: {', '.join(STDLIB)} sources, {len(ids)} tokens, windows of {args.context}")
    fmt = ChatFormat(tok)
    prompts = [tok.encode(fmt.prompt_text(c)) for c in CHATS]
    greedy = SamplingConfig(temperature=0.0)
    base_ppl, outputs = None, {}
    print(f"{'cache':<6}{'ppl':>9}{'change':>9}{'B/token':>9}{'1 GiB holds':>13}  greedy = auto")
    for name in DTYPES:
        dtype = kv_cache_dtype(name)
        ppl = cached_perplexity(model, ids, args.context, dtype)
        base_ppl = base_ppl or ppl
        config = GenerationConfig(
            args.new_tokens, greedy, stop_tokens=fmt.stop_tokens, kv_cache_dtype=dtype
        )
        outputs[name] = [generate(model, [p], config)[0] for p in prompts]
        same = []
        for got, want in zip(outputs[name], outputs["auto"]):
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if n is None and len(got) == len(want):
                same.append("all")
            else:  # the first n tokens equal
                same.append(f"{min(len(got), len(want)) if n is None else n}/{len(want)}")
        per_token = PagedKVCache.token_bytes(model, dtype)
        print(
            f"{name:<6}{ppl:>9.4f}{100 * (ppl / base_ppl - 1):>+8.3f}%{per_token:>9,}"
            f"{KV_MEMORY // per_token:>13,}  {' '.join(same)}"
        )
    for c, tokens in zip(CHATS, outputs["int8"]):
        print(f"# int8 reply to {c!r}: {tok.decode(tokens)!r}")


if __name__ == "__main__":
    main()
