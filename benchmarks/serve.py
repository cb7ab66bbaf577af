"""Serving benchmark: `attnlab serve` under N concurrent streaming clients, against the same
requests run one at a time through `attnlab.inference.generate` in the same run.

    .venv/bin/python benchmarks/serve.py                     # GPT-2-small shape, 16 clients
    .venv/bin/python benchmarks/serve.py --disconnect 0.2    # 20% of clients drop mid-stream
    .venv/bin/python benchmarks/serve.py --quick             # 2 layers, few short requests

The script writes a random-weight checkpoint (GPT-2-small's shape: 12 layers, d_model 768,
vocabulary 50257; a small byte-level tokenizer decodes what it can), starts
`python -m attnlab serve` on a free loopback port, and sends --requests streaming completions
with mixed prompt and output lengths (seeded), at most --concurrency at once, for at most
--max-seconds. Prompts are token ids; sampling is greedy; every request asks for `logprobs=0`,
so each streamed chunk names the tokens it carries and tokens are counted exactly.

Reported, for the server and for the baseline (the same prompts and max_tokens, one after the
other, `generate` in this process, the server idle):

  requests/s          finished requests / wall time of the whole run
  output tokens/s     generated tokens / wall time
  TTFT p50 / p99      from sending a request to its first token (the baseline: from the moment
                      its own `generate` call starts, so it excludes the time spent queueing)
  per-token p50 / p99 gaps between consecutive tokens of one request

and the server's output tokens/s while every client has a request in flight (from the first
request sent to the last: after that the run drains with fewer), against the baseline's.

--keep-freed-memory, --fast-linear and --compile-attention turn on the server's speed options.
The first two also apply to the baseline (this process's allocator; its model's Linears), so
both sides run the same kernels; the third only exists for the paged cache's batched decode.

--disconnect F: a fraction F of the clients (chosen by the seed) close their stream halfway
through their tokens. Afterwards the script waits for the engine to go idle and checks that
/metrics shows every KV block back in the pool and that the server's resident memory is back
to its level before the run (measured after a warm-up round), within --rss-slack MiB.

Shared machines are noisy: compare the ratio, measured within one run.
"""

import os

# As benchmarks/decode.py: on a busy machine, OpenMP threads sleep instead of spinning at
# barriers. Here it matters more: a spinning worker also takes the core the server's event loop
# needs to stream tokens. Set before torch loads; the server process inherits it.
if os.getloadavg()[0] >= len(os.sched_getaffinity(0)):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from _timing import cpu_name, use_all_cores  # noqa: E402

from attnlab.accel.fast_linear import enable_fast_linear  # noqa: E402
from attnlab.accel.host_memory import keep_freed_memory  # noqa: E402
from attnlab.checkpoint import open_checkpoint, save_pretrained  # noqa: E402
from attnlab.inference.config import GenerationConfig  # noqa: E402
from attnlab.inference.generate import generate  # noqa: E402
from attnlab.inference.sampling import SamplingConfig  # noqa: E402
from attnlab.models.build import build_model  # noqa: E402
from attnlab.models.presets import gpt2  # noqa: E402
from attnlab.tokenizer import train_bpe_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 4.0  # issue 22: >= 4x the one-at-a-time output tokens/s at 16 clients


@dataclass
class Result:
    """One request's timeline as the client saw it."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one entry per token
    dropped: bool = False
    error: str | None = None


def model_config(quick: bool):
    cfg = gpt2()
    if quick:
        attention = replace(cfg.attention, n_heads=4)
        small = dict(n_layers=2, d_model=256, d_ff=1024, vocab_size=8192, max_seq_len=256)
        cfg = replace(cfg, attention=attention, **small)
    return cfg


def write_checkpoint(path: Path, quick: bool) -> Path:
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer(["a small corpus for a byte-level tokenizer. " * 20], 300)
    cfg = model_config(quick)
    return save_pretrained(path, build_model(cfg).eval(), cfg, tokenizer)


def make_requests(args) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request: lengths drawn uniformly from the ranges."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        prompt = [rng.randrange(3, 260) for _ in range(rng.randint(*args.prompt_len))]
        out.append((prompt, rng.randint(*args.output_len)))
    return out


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "attnlab", "--threads", str(torch.get_num_threads())]
    cmd += ["serve", "--ckpt", str(ckpt), "--port", "0"]
    cmd += ["--engine", args.engine, "--max-batch", str(args.concurrency)]
    cmd += ["--max-queue", str(max(64, args.requests)), "--model-name", "bench"]
    cmd += ["--keep-freed-memory"] if args.keep_freed_memory else []
    cmd += ["--compile-attention"] if args.compile_attention else []
    cmd += ["--fast-linear"] if args.fast_linear else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split("/v1")[0]


async def one_request(client, url, prompt, max_tokens, drop_after, result: Result) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "logprobs": 0}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                logprobs = (chunk.get("choices") or [{}])[0].get("logprobs") or {}
                now = time.perf_counter()
                result.arrivals += [now] * len(logprobs.get("tokens", []))
                if drop_after is not None and len(result.arrivals) >= drop_after:
                    result.dropped = True
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"


async def load(url: str, requests, args) -> tuple[list[Result], float]:
    """All requests, at most args.concurrency in flight, for at most args.max_seconds."""
    rng = random.Random(args.seed + 1)
    drops = [max(1, n // 2) if rng.random() < args.disconnect else None for _, n in requests]
    gate = asyncio.Semaphore(args.concurrency)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)

    async with httpx.AsyncClient(timeout=args.max_seconds, limits=limits) as client:

        async def run(i):
            async with gate:
                result = Result(time.perf_counter())
                results.append(result)
                await one_request(client, url, *requests[i], drops[i], result)

        start = time.perf_counter()
        tasks = [asyncio.create_task(run(i)) for i in range(len(requests))]
        done, pending = await asyncio.wait(tasks, timeout=args.max_seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    return results, wall


def full_window(results: list[Result]) -> tuple[float, int]:
    """(seconds, tokens) from the first request sent to the last one sent: while every client
    has a request in flight (after the last is sent, the run drains with fewer)."""
    first, last = min(r.sent for r in results), max(r.sent for r in results)
    tokens = sum(first <= t <= last for r in results for t in r.arrivals)
    return last - first, tokens


def baseline(ckpt: Path, requests, args) -> tuple[list[Result], float]:
    """The same requests one at a time through `generate` (stopping at <eos>, as the server)."""
    loaded = open_checkpoint(ckpt)
    if args.fast_linear:
        enable_fast_linear(loaded.model)  # the same Linears as the server's
    eos = loaded.tokenizer.token_id("<eos>")
    generate(
        loaded.model, [requests[0][0]], GenerationConfig(2, SamplingConfig(temperature=0))
    )  # warm-up
    results, start = [], time.perf_counter()
    for prompt, max_tokens in requests:
        if time.perf_counter() - start > args.max_seconds:
            break
        result = Result(time.perf_counter())

        def arrived(token, result=result):
            result.arrivals.append(time.perf_counter())

        generate(
            loaded.model,
            [prompt],
            GenerationConfig(max_tokens, SamplingConfig(temperature=0), stop_tokens=[eos]),
            on_token=arrived,
        )
        results.append(result)
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> str:
    if not values:
        return "     -        -"
    values = sorted(values)
    p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    return f"{statistics.median(values) * 1e3:8.1f} {p99 * 1e3:8.1f}"


def summarize(name: str, results: list[Result], wall: float) -> float:
    finished = [r for r in results if r.arrivals and not r.dropped and r.error is None]
    tokens = sum(len(r.arrivals) for r in results)
    ttft = [r.arrivals[0] - r.sent for r in results if r.arrivals]
    gaps = [b - a for r in results for a, b in zip(r.arrivals, r.arrivals[1:])]
    tps = tokens / wall
    rate = len(finished) / wall
    print(f"{name:<24} {rate:8.2f} {tps:10.1f} {percentiles(ttft)} {percentiles(gaps)}")
    return tps


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    pairs = (line.split(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {k: float(v) for k, v in pairs if "{" not in k}


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return (
        next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        / 1024
    )


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m.get("attnlab_running", 0) == 0 and m.get("attnlab_waiting", 0) == 0
        ) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 layers, 8 short requests: a smoke run"
    )
    parser.add_argument("--engine", choices=("batched", "sequential"), default="batched")
    parser.add_argument("--concurrency", type=int, default=16, help="clients at once (default 16)")
    parser.add_argument("--requests", type=int, help="requests in all (default 64; quick 8)")
    parser.add_argument("--max-seconds", type=float, default=600, help="bound on each phase")
    parser.add_argument(
        "--disconnect",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of clients that drop mid-stream",
    )
    parser.add_argument(
        "--rss-slack", type=float, default=32, metavar="MiB", help="allowed RSS growth"
    )
    parser.add_argument(
        "--compile-attention",
        action="store_true",
        help="the server's decode steps attend through the compiled paged kernel",
    )
    parser.add_argument(
        "--fast-linear",
        action="store_true",
        help="Linears through oneDNN, in the server (its flag) and in the baseline's model",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory, in the server (its flag) and in this process for the "
        "one-at-a-time baseline: both sides run with the same allocator setting",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    args.requests = args.requests or (8 if args.quick else 64)
    args.prompt_len = (4, 24) if args.quick else (16, 256)
    args.output_len = (4, 16) if args.quick else (32, 256)
    cfg = model_config(args.quick)
    threads = use_all_cores()  # the server gets the same count (--threads)
    print(
        f"attnlab serve benchmark: {cpu_name()}, {threads} threads for the server and for "
        f"generate (load average {os.getloadavg()[0]:.1f} at start, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}), torch {torch.__version__}, "
        f"{platform.system()} {platform.release()}"
    )
    print(
        f"model: random {cfg.n_layers} layers x d_model {cfg.d_model}, vocab {cfg.vocab_size}; "
        f"engine {args.engine}; {args.requests} requests, {args.concurrency} at once, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-"
        f"{args.output_len[1]}, greedy; disconnect {args.disconnect:.0%}; keep freed memory "
        f"{'on' if args.keep_freed_memory else 'off'} (server and generate); compiled paged "
        f"attention {'on' if args.compile_attention else 'off'}; oneDNN Linears "
        f"{'on' if args.fast_linear else 'off'} (server and generate)"
    )
    requests = make_requests(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "model", args.quick)
        proc, url = start_server(ckpt, args)
        try:
            warmup = argparse.Namespace(**{**vars(args), "disconnect": 0.0})  # all to the end
            asyncio.run(load(url, requests[: args.concurrency], warmup))
            before = wait_idle(url)
            rss_before = rss_mib(proc.pid)
            results, wall = asyncio.run(load(url, requests, args))
            after = wait_idle(url)
            rss_after = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        base_results, base_wall = baseline(ckpt, requests, args)
    errors = [r.error for r in results if r.error]
    print()
    heads = ("req/s", "out tok/s", "TTFT ms", "p99", "tok ms", "p99")
    print(f"{'':<24} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, (8, 10, 8, 8, 8, 8))))
    print(f"{'':<24} {'':>8} {'':>10} {'p50':>8} {'':>8} {'p50':>8} {'':>8}")
    served = summarize(f"server ({args.concurrency} clients)", results, wall)
    alone = summarize("generate, one at a time", base_results, base_wall)
    print()
    ratio = served / alone
    verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
    target = f"target >= {TARGET_RATIO:g}x at 16 clients: {verdict}"
    print(f"output tokens/s, server / one at a time: {ratio:.2f}x ({target})")
    seconds, tokens = full_window(results)
    if seconds > 0 and len(results) > args.concurrency:
        print(
            f"while all {args.concurrency} clients had a request in flight (the first "
            f"{seconds:.1f} s, before the run drains): {tokens / seconds:.1f} out tok/s, "
            f"{tokens / seconds / alone:.2f}x one at a time"
        )
    if errors:
        print(f"{len(errors)} requests failed, e.g. {errors[0]}")
    if args.disconnect:
        dropped = sum(r.dropped for r in results)
        used = after.get("attnlab_kv_blocks_used", float("nan"))
        total = after.get("attnlab_kv_blocks_total", float("nan"))
        grew = rss_after - rss_before
        print(
            f"disconnect: {dropped} of {len(results)} clients dropped mid-stream; KV blocks in use "
            f"after: {used:g} of {total:g} ({'PASS' if used == 0 else 'MISS'}); server RSS "
            f"{rss_before:.0f} -> {rss_after:.0f} MiB ({grew:+.0f}, slack {args.rss_slack:g}: "
            f"{'PASS' if grew <= args.rss_slack else 'MISS'})"
        )
        key = "attnlab_requests_finished_total"
        finished = after.get(key, 0) - before.get(key, 0)
        print(f"requests the engine finished (cancelled included): {finished:g}")


if __name__ == "__main__":
    main()
