"""Resident memory of `attnlab serve` against llama-cpp-python's OpenAI server, same GGUF, same
context.

    .venv/bin/python benchmarks/memory.py                      # SmolLM2, its 8192-token context
    .venv/bin/python benchmarks/memory.py --attnlab-scheme int4  # attnlab's Q4_1 matrices kept

Each server is started alone on the file (attnlab with its defaults: `serve --ckpt FILE`, the
GGUF dequantized to fp32, its KV pool by `--kv-cache-memory`'s default; llama.cpp with
`--n_ctx` the model's context, one context its slots share), then gets 1 stream, then 16
concurrent streams (greedy completions of 128 tokens on prompts of 64-256 tokens cut from this
repository's Python files), three times over. The table gives its peak resident memory
(VmHWM of /proc/PID/status: the most it held at once) after start-up and after each load, and
its resident memory at the end of each repeat (VmRSS: flat when nothing grows).
"""

import argparse
import asyncio
import os
import sys
from pathlib import Path

from _timing import cpu_name
from serve_llamacpp import load, make_requests, start_attnlab, start_llamacpp

from attnlab.checkpoint import open_checkpoint
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path


def status_mib(pid: int, field: str) -> float:
    """A memory field of /proc/PID/status (VmHWM, VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure(name: str, proc, url: str, loads) -> list[str]:
    """The server's peak and current memory after start-up and after each (clients, requests)."""
    pid = proc.pid
    rows = [
        f"{name:<10}{'start':>10}{status_mib(pid, 'VmHWM'):>10.0f}{status_mib(pid, 'VmRSS'):>10.0f}"
    ]
    for repeat in range(3):
        for clients, requests in loads:
            results, _ = asyncio.run(load(url, requests, clients))
            errors = [r.error for r in results if r.error]
            if errors:
                raise SystemExit(f"{name}: {len(errors)} failed requests: {errors[0]}")
            rows.append(
                f"{name:<10}{f'{clients} x{repeat + 1}':>10}{status_mib(pid, 'VmHWM'):>10.0f}"
                f"{status_mib(pid, 'VmRSS'):>10.0f}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gguf", type=Path, help="the SmolLM2 GGUF file (default: attnlab's cache)"
    )
    parser.add_argument("--attnlab-scheme", choices=("fp32", "int4"), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    path = args.gguf or packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path}: not found; run `attnlab download smollm2-135m-instruct` first")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python[server] is not installed: pip install -e '.[bench]'")
    loaded = open_checkpoint(path)
    context = loaded.config.max_seq_len
    tokenizer = loaded.tokenizer
    del loaded
    loads = [(n, make_requests(tokenizer, n, n, (64, 256), (128, 128))) for n in (1, 16)]
    for _, requests in loads:
        requests[:] = [(prompt, 128) for prompt, _ in requests]
    print(f"resident memory: attnlab serve vs llama_cpp.server on {path.name}, context {context}")
    print(f"CPU: {cpu_name()}; threads {args.threads} each; attnlab {args.attnlab_scheme}")
    print(f"\n{'server':<10}{'after':>10}{'peak MiB':>10}{'now MiB':>10}")
    peaks = {}
    for name, start in (
        ("attnlab", lambda: start_attnlab(path, args.threads, args.attnlab_scheme, 16)),
        ("llama.cpp", lambda: start_llamacpp(path, args.threads, n_ctx=context)),
    ):
        proc, url = start()
        try:
            rows = measure(name, proc, url, loads)
            peaks[name] = status_mib(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        print("\n".join(rows), flush=True)
    print(f"\npeak ratio attnlab / llama.cpp: {peaks['attnlab'] / peaks['llama.cpp']:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
