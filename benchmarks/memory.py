"""Resident memory of `attnlab serve` against llama-cpp-python's OpenAI server, and of `attnlab
generate` against llama.cpp's Llama, same GGUF, same context.

    .venv/bin/python benchmarks/memory.py                      # SmolLM2, its 8192-token context
    .venv/bin/python benchmarks/memory.py --attnlab-scheme int4  # attnlab's Q4_1 matrices kept
    .venv/bin/python benchmarks/memory.py --part generate        # one generation per process

Each server is started alone on the file (attnlab with its defaults: `serve --ckpt FILE`, the
GGUF dequantized to fp32, its KV pool by `--kv-cache-memory`'s default; llama.cpp with
`--n_ctx` the model's context, one context its slots share), then gets 1 stream, then 16
concurrent streams (greedy completions of 128 tokens on prompts of 64-256 tokens cut from this
repository's Python files), three times over. The table gives its peak resident memory
(VmHWM of /proc/PID/status: the most it held at once) after start-up and after each load, and
its resident memory at the end of each repeat (VmRSS: flat when nothing grows).

Then one generation each, a new process from start to exit: `attnlab generate` on the file (fp32,
as `serve`) and on its int4 checkpoint (the Q4_1 matrices kept), against llama-cpp-python's
`Llama(file)` with a context of prompt + new tokens (attnlab's generate sizes its cache so); a
256-token prompt, 128 greedy new tokens. The figure is the process's peak resident memory (its
ru_maxrss, from wait4), the median of three runs.
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _timing import cpu_name
from serve_llamacpp import int4_checkpoint, load, make_requests, start_attnlab, start_llamacpp

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


LLAMA_GENERATE = (
    "import sys; from llama_cpp import Llama; "
    "m = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), verbose=False); "
    "m.create_completion(sys.argv[4], max_tokens=int(sys.argv[5]), temperature=0)"
)


# Linux starts a new process's ru_maxrss at the peak of the process it was forked from (this
# one, which holds the model: every child would read >= its 967 MiB). So a small launcher forks
# the command and reports its ru_maxrss.
LAUNCHER = (
    "import os, sys; pid = os.fork()\n"
    "if pid == 0: os.execv(sys.argv[1], sys.argv[1:])\n"
    "_, status, usage = os.wait4(pid, 0); print(usage.ru_maxrss); sys.exit(status >> 8)"
)


def peak_of(cmd: list[str]) -> float:
    """Peak resident memory (MiB) of `cmd` run to its end: its ru_maxrss, from wait4."""
    run = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed: {run.stderr[-500:]}")
    return int(run.stdout.split()[-1]) / 1024


def generate_peaks(path: Path, tokenizer, threads: int, new: int = 128) -> None:
    """One generation per process: attnlab generate (fp32, int4) against llama.cpp's Llama."""
    prompt, _ = make_requests(tokenizer, 1, 7, (256, 256), (new, new))[0]
    context = len(tokenizer.encode(prompt)) + new
    attnlab = [sys.executable, "-m", "attnlab", "--threads", str(threads), "generate"]
    attnlab += ["--prompt", prompt, "--max-new-tokens", str(new), "--temperature", "0"]
    int4 = int4_checkpoint(path)
    runs = {
        "attnlab generate (fp32)": attnlab + ["--ckpt", str(path)],
        "attnlab generate (int4)": attnlab + ["--ckpt", str(int4)],
        f"llama.cpp Llama(n_ctx={context})": [sys.executable, "-c", LLAMA_GENERATE, str(path)]
        + [str(context), str(threads), prompt, str(new)],
    }
    peaks = {name: [] for name in runs}
    for _ in range(3):  # interleaved
        for name, cmd in runs.items():
            peaks[name].append(peak_of(cmd))
    print(f"\none generation, {new} greedy tokens after a 256-token prompt: peak MiB (of 3)")
    base = statistics.median(peaks[next(reversed(peaks))])
    for name, values in peaks.items():
        peak = statistics.median(values)
        print(f"{name:<34}{peak:>8.0f}  x{peak / base:.2f}  {[round(v) for v in values]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gguf", type=Path, help="the SmolLM2 GGUF file (default: attnlab's cache)"
    )
    parser.add_argument("--attnlab-scheme", choices=("fp32", "int4"), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--part", choices=("all", "serve", "generate"), default="all")
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
    print(f"resident memory: attnlab against llama.cpp on {path.name}")
    print(f"CPU: {cpu_name()}; threads {args.threads} each")
    if args.part != "generate":
        serve_peaks(path, tokenizer, context, args)
    if args.part != "serve":
        generate_peaks(path, tokenizer, args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}")


def serve_peaks(path: Path, tokenizer, context: int, args) -> None:
    """attnlab serve (its defaults) against llama_cpp.server, 1 then 16 streams, 3 repeats."""
    loads = [(n, make_requests(tokenizer, n, n, (64, 256), (128, 128))) for n in (1, 16)]
    for _, requests in loads:
        requests[:] = [(prompt, 128) for prompt, _ in requests]
    print(f"\nservers, context {context}; attnlab {args.attnlab_scheme}")
    print(f"{'server':<10}{'after':>10}{'peak MiB':>10}{'now MiB':>10}")
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


if __name__ == "__main__":
    main()
