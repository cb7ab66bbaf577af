"""Serving SmolLM2-135M-Instruct: `attnlab serve` against llama-cpp-python's OpenAI server.

    .venv/bin/pip install -c constraints.txt -e '.[bench]'   # llama-cpp-python (+ its server)
    .venv/bin/python benchmarks/serve_llamacpp.py            # 1, 4, 16 clients; ~15 min on 2 cores
    .venv/bin/python benchmarks/serve_llamacpp.py --quick    # 1 and 4 clients, few requests
    .venv/bin/python benchmarks/serve_llamacpp.py --isa avx2 --threads 1   # an AVX2-only CPU
                                                              # (benchmarks/_isa.py)
    .venv/bin/python benchmarks/serve_llamacpp.py --compiled  # + attnlab serve --compile

Both servers open the same GGUF file (Q4_1 as shipped; attnlab serves it with its Q4_1
matrices kept as int4, written once as an attnlab checkpoint, or dequantized to fp32 with
`--attnlab-scheme fp32`), use the same thread
count, listen on 127.0.0.1 and get the same streaming completions: text prompts of 16-256
tokens cut from this repository's Python files, 64-256 new tokens, greedy, drawn with a seed.
For each number of concurrent clients the two servers take turns (attnlab, llama.cpp, attnlab,
llama.cpp, ...: --rounds each), and the table gives the medians over rounds of

  out tok/s       streamed tokens (one per chunk) / wall time of the round
  /CPU-s          streamed tokens / CPU seconds of the server process in the round (all its
                  threads; a shared machine's stolen time drops out)
  TTFT p50 / p99  from sending a request to its first token, over every request of the rounds

llama-cpp-python's server runs one completion at a time (it holds a lock around the model; it
is started with `--interrupt_requests False`, else each new request cuts the running stream
short); attnlab's batches every request in flight into one decode step. `tokens` is what each
server streamed in a round (the same work: a reply ends at max_tokens or at the model's EOS).
llama.cpp's extra buffer types (AMX, repacked weights) are off, as in benchmarks/llamacpp.py.
"""

import argparse
import asyncio
import atexit
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _isa import add_isa_args, apply_isa, isa_header
from _timing import cpu_name
from serve import Result

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.quantized import save_quantized
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, every thread of it (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {url}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not answer within {timeout:.0f} s")


def int4_checkpoint(path: Path) -> Path:
    """An attnlab checkpoint directory of the GGUF file with its Q4_1 matrices kept (Int4Linear),
    removed when this process exits."""
    loaded = open_checkpoint(path, scheme="int4")
    out = Path(tempfile.mkdtemp(prefix="attnlab-smollm2-int4-"))
    atexit.register(shutil.rmtree, out, True)
    return save_quantized(loaded.model, out, "int4", 32, loaded.run, loaded.tokenizer)


def start_attnlab(path: Path, threads: int, scheme: str, clients: int, flags=()) -> tuple:
    """`attnlab serve` of the file (fp32: dequantized) or of its int4 checkpoint, with
    `flags` (e.g. --compile)."""
    path = int4_checkpoint(path) if scheme == "int4" else path
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "attnlab", "--threads", str(threads), "serve", "--ckpt", str(path)]
    cmd += ["--port", str(port), "--model-name", "bench", "--max-batch", str(max(clients, 1))]
    proc = subprocess.Popen([*cmd, *flags], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, timeout=1800)  # --compile: minutes the first time
    return proc, url


# llama_cpp.server's own main, after turning llama.cpp's extra buffer types off as
# benchmarks/llamacpp.py does (its AMX buffers crash Q4_1 models on the VM these ran on)
SERVER = (
    "import sys; sys.path.insert(0, {bench!r}); from llamacpp import without_extra_buffers; "
    "without_extra_buffers(); sys.argv[0] = 'llama_cpp.server'; "
    "from llama_cpp.server.__main__ import main; main()"
)


def start_llamacpp(path: Path, threads: int, n_ctx: int) -> tuple:
    port = free_port()
    code = SERVER.format(bench=str(ROOT / "benchmarks"))
    cmd = [sys.executable, "-c", code, "--model", str(path), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    cmd += ["--n_ctx", str(n_ctx), "--model_alias", "bench"]
    # By default a request that arrives while another streams ends that stream at once
    # (`interrupt_requests`): with more clients than one, most replies would be cut short.
    cmd += ["--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def make_requests(tokenizer, n: int, seed: int, prompt_len, output_len) -> list[tuple[str, int]]:
    """(prompt text, max_tokens): token windows of this repository's Python files, decoded."""
    ids = []
    for f in sorted((ROOT / "attnlab").rglob("*.py"))[:40]:
        ids += tokenizer.encode(f.read_text())
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(len(ids) - length)
        out.append((tokenizer.decode(ids[start : start + length]), rng.randint(*output_len)))
    return out


async def one_request(client, url: str, prompt: str, max_tokens: int, result: Result) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["stream"] = True
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:]).get("choices"):
                        result.arrivals.append(time.perf_counter())
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"


async def load(url: str, requests, clients: int) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(clients)
    results: list[Result] = []
    async with httpx.AsyncClient(
        timeout=900, limits=httpx.Limits(max_connections=clients + 4)
    ) as c:

        async def run(prompt, max_tokens):
            async with gate:
                result = Result(time.perf_counter())
                results.append(result)
                await one_request(c, url, prompt, max_tokens, result)

        start = time.perf_counter()
        await asyncio.gather(*(run(p, n) for p, n in requests))
    return results, time.perf_counter() - start


def ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gguf", type=Path, help="the SmolLM2 GGUF file (default: attnlab's cache)"
    )
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 8 short requests")
    parser.add_argument("--clients", type=int, nargs="+", help="default 1 4 16 (quick 1 4)")
    parser.add_argument("--requests", type=int, help="per round (default 2 x clients, >= 8)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--attnlab-scheme", choices=("int4", "fp32"), default="int4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="a third server in the same rounds: attnlab serve --compile (its decode step one "
        "compiled graph)",
    )
    add_isa_args(parser)
    args = parser.parse_args()
    apply_isa(args)  # the servers inherit its environment
    path = args.gguf or packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path}: not found; run `attnlab download smollm2-135m-instruct` first")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python[server] is not installed: pip install -e '.[bench]'")
    clients = args.clients or ([1, 4] if args.quick else [1, 4, 16])
    prompt_len, output_len = ((16, 64), (16, 32)) if args.quick else ((16, 256), (64, 256))
    threads = args.threads or len(os.sched_getaffinity(0))
    tokenizer = open_checkpoint(path).tokenizer
    print(f"attnlab serve vs llama_cpp.server {llama_cpp.__version__} on {path.name}")
    print(
        f"CPU: {cpu_name()}; threads {threads} each; attnlab {args.attnlab_scheme}; llama.cpp "
        f"Q4_1; prompts {prompt_len} tokens, outputs {output_len}; rounds {args.rounds}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(isa_header(args.isa))
    servers = {"attnlab": start_attnlab(path, threads, args.attnlab_scheme, max(clients))}
    if args.compiled:
        flags = ["--compile"]
        servers["attnlab-c"] = start_attnlab(
            path, threads, args.attnlab_scheme, max(clients), flags
        )
    servers["llama.cpp"] = start_llamacpp(path, threads, n_ctx=2048)
    warmup = make_requests(tokenizer, 2, args.seed, prompt_len, output_len)
    for _, url in servers.values():  # first-request costs (allocations, lazy set-up) untimed
        asyncio.run(load(url, warmup, 1))
    print(
        f"\n{'clients':>7} {'server':<10}{'out tok/s':>10}{'/CPU-s':>8}{'TTFT p50':>10}"
        f"{'p99':>8}  ms{'tokens':>9}"
    )
    try:
        for n in clients:
            requests = make_requests(
                tokenizer, args.requests or max(8, 2 * n), args.seed + n, prompt_len, output_len
            )
            # tok/s, TTFTs, tokens, tok/CPU-s (the server process's) per round
            stats = {name: ([], [], [], []) for name in servers}
            for r in range(args.rounds):
                for name, (proc, url) in servers.items():
                    cpu = cpu_seconds(proc.pid)
                    results, wall = asyncio.run(load(url, requests, n))
                    cpu = cpu_seconds(proc.pid) - cpu
                    errors = [x.error for x in results if x.error]
                    if errors:
                        raise SystemExit(f"{name}: {len(errors)} failed requests: {errors[0]}")
                    tokens = sum(len(x.arrivals) for x in results)
                    stats[name][0].append(tokens / wall)
                    stats[name][2].append(tokens)
                    stats[name][3].append(tokens / cpu)
                    stats[name][1].extend(x.arrivals[0] - x.sent for x in results if x.arrivals)
                    print(f"   round {r + 1}: {name} {wall:.1f} s", file=sys.stderr, flush=True)
            rates, per_cpu = {}, {}
            for name, (tps, ttft, tokens, tpc) in stats.items():
                rates[name], per_cpu[name] = statistics.median(tps), statistics.median(tpc)
                p50, p99 = ms(ttft, 0.5), ms(ttft, 0.99)
                print(
                    f"{n:>7} {name:<10}{rates[name]:>10.1f}{per_cpu[name]:>8.1f}{p50:>10.0f}"
                    f"{p99:>8.0f}{'':>4}{statistics.median(tokens):>9.0f}"
                )
            for name in [n for n in servers if n != "llama.cpp"]:
                ratio, cpu_ratio = (d[name] / d["llama.cpp"] for d in (rates, per_cpu))
                label = "ratio" if name == "attnlab" else f"ratio {name[-1]}"
                print(f"{'':>7} {label:<10}{ratio:>10.2f}{cpu_ratio:>8.2f}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
