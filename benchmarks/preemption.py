"""Many long requests against a KV pool that holds a few: preemption on SmolLM2 (issue 43).

    .venv/bin/python benchmarks/preemption.py                 # 64 requests of ~2k tokens, pool of 8
    .venv/bin/python benchmarks/preemption.py --requests 16 --pool-requests 2 --prompt-tokens 500

First each request runs alone (a server of its own, `--max-batch 1`: nothing to share the pool
with, so nothing is preempted): these are the reference replies. Then one `attnlab serve` with
`--max-batch REQUESTS` and a pool of `--kv-cache-memory` sized for POOL_REQUESTS whole requests
gets every request at once, streaming, greedy, three times over. The pool fills, the scheduler
preempts the newest sequences (their blocks freed, their prefix recomputed when they resume), and
each stream goes on. For each repeat the table gives: requests that failed, replies that differ
from the same request alone, preemptions (the server's /metrics), the wall time, and the server's
resident memory at the end of the repeat (VmRSS) and at its peak so far (VmHWM).
"""

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _timing import cpu_name
from memory import status_mib
from serve_llamacpp import free_port, wait_ready

from attnlab.checkpoint import open_checkpoint
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path

ROOT = Path(__file__).resolve().parents[1]


def prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n token windows of about `length` tokens (+-5%) from this Python's standard library."""
    text = "".join(
        p.read_text(errors="replace") for p in sorted(Path(os.__file__).parent.glob("*.py"))[:60]
    )
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.randint(int(length * 0.95), int(length * 1.05))
        start = rng.randrange(len(ids) - size)
        out.append(ids[start : start + size])
    return out


def start_server(path: Path, threads: int, max_batch: int, kv_bytes: int | None, context: int):
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "attnlab", "--threads", str(threads), "serve", "--ckpt", str(path)]
    cmd += ["--port", str(port), "--model-name", "bench", "--max-batch", str(max_batch)]
    cmd += ["--max-queue", str(max(64, max_batch)), "--max-context", str(context)]
    if kv_bytes:
        cmd += ["--kv-cache-memory", f"{kv_bytes // 2**20}MiB"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    pool = next(line for line in proc.stdout if "KV pool of" in line).strip()
    return proc, url, pool


def bytes_per_token(pool: str) -> float:
    """From the server's line 'KV pool of N tokens (M MiB, ...'."""
    match = re.search(r"KV pool of ([\d,]+) tokens \(([\d,]+) MiB", pool)
    return int(match[2].replace(",", "")) * 2**20 / int(match[1].replace(",", ""))


async def complete(client, url: str, prompt: list[int], new: int) -> tuple[str, str | None]:
    """(the streamed reply, an error or None): greedy, `new` tokens, no early stop."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    text = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "".join(text), str(chunk["error"])[:200]
                    text += [c["text"] for c in chunk.get("choices", [])]
    except httpx.HTTPError as e:
        return "".join(text), f"{type(e).__name__}: {e}"
    return "".join(text), None


async def run_all(url: str, requests: list[list[int]], new: int, clients: int):
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def one(prompt):
            async with gate:
                return await complete(client, url, prompt, new)

        return await asyncio.gather(*(one(p) for p in requests))


def preemptions(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("attnlab_preemptions_total"):
            return int(float(line.split()[-1]))
    raise SystemExit(f"{url}/metrics has no attnlab_preemptions_total")


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gguf", type=Path, help="the SmolLM2 GGUF file (default: attnlab's cache)"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--pool-requests", type=float, default=8, help="whole requests the pool holds"
    )
    parser.add_argument("--prompt-tokens", type=int, default=1920)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = args.gguf or packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path}: not found; run `attnlab download smollm2-135m-instruct` first")
    loaded = open_checkpoint(path)
    tokenizer = loaded.tokenizer
    del loaded
    requests = prompts(tokenizer, args.requests, args.prompt_tokens, args.seed)
    context = max(map(len, requests)) + args.new_tokens
    print(f"preemption: {args.requests} streaming greedy requests of {args.prompt_tokens} +-5%")
    print(f"prompt tokens + {args.new_tokens} new on {path.name}, a KV pool for")
    print(f"~{args.pool_requests:g} of them; CPU: {cpu_name()}; threads {args.threads}")

    t0 = time.perf_counter()
    proc, url, pool = start_server(path, args.threads, 1, None, context)
    kv_bytes = int(args.pool_requests * context * bytes_per_token(pool))
    alone = asyncio.run(run_all(url, requests, args.new_tokens, 1))
    stop(proc)
    errors = [e for _, e in alone if e]
    if errors:
        sys.exit(f"alone: {len(errors)} failed: {errors[0]}")
    print(f"each request alone (--max-batch 1): {time.perf_counter() - t0:.0f} s")

    proc, url, pool = start_server(path, args.threads, args.requests, kv_bytes, context)
    print(pool)
    header = ("repeat", "errors", "differ", "preempted", "wall s", "RSS MiB", "peak MiB")
    print("\n" + "".join(f"{h:>10}" for h in header))
    before = preemptions(url)
    for repeat in range(1, args.repeats + 1):
        start = time.perf_counter()
        replies = asyncio.run(run_all(url, requests, args.new_tokens, args.requests))
        wall = time.perf_counter() - start
        failed = sum(e is not None for _, e in replies)
        differ = sum(r != a for (r, _), (a, _) in zip(replies, alone))
        now = preemptions(url)
        rss, peak = status_mib(proc.pid, "VmRSS"), status_mib(proc.pid, "VmHWM")
        row = (repeat, failed, differ, now - before, f"{wall:.0f}", f"{rss:.0f}", f"{peak:.0f}")
        print("".join(f"{v:>10}" for v in row), flush=True)
        before = now
    stop(proc)


if __name__ == "__main__":
    main()
