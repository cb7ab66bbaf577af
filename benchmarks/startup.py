"""Start-up: a new process to its first tokens, attnlab against llama.cpp on the same GGUF file.

    python benchmarks/startup.py [--isa avx2|native] [--threads N] [--rounds 5] [--cold-rounds 1]

Each candidate is a whole new process that loads SmolLM2-135M-Instruct (the Q4_1 GGUF of
`attnlab download smollm2-135m-instruct`), writes 2 greedy tokens (the prefill's and one decode
step's: the step `--compile` compiles) and exits; the time is the process's whole life, wall
and CPU (its own and its threads', from wait4):

    llama.cpp           llama-cpp-python: Llama(file) and create_completion(max_tokens=2)
    attnlab             attnlab generate --ckpt FILE --max-new-tokens 2 (int4 on the GGUF)
    attnlab --compile   the same through the compiled decode step, warm: inductor's on-disk
                        caches (TORCHINDUCTOR_CACHE_DIR) already hold the graph
    attnlab --compile   cold: an empty cache directory, so it compiles (--cold-rounds times)

Every process runs once before the rounds (the file in the page cache, the qdot kernels
built, the warm cache filled); then the rounds, each candidate in turn (A B C A B C), and the
medians. The targets (issue 41): cold start <= 2x llama.cpp's, warm start <= 1.2x.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _isa import add_isa_args, apply_isa, isa_header  # noqa: E402
from _timing import cpu_name  # noqa: E402

PROMPT = "The capital of France is"  # " Paris.": no end of text in 2 tokens
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=256, verbose=False)
llm.create_completion(sys.argv[3], max_tokens=2, temperature=0.0)
"""


def run(command: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s) of one process, start to exit; it must exit 0."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_isa_args(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold-rounds", type=int, default=1, help="compiles from nothing")
    args = parser.parse_args()
    apply_isa(args)
    from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path

    path = str(packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"]))
    threads = args.threads or len(os.sched_getaffinity(0))
    python = sys.executable
    attnlab = [python, "-m", "attnlab", "generate", "--ckpt", path, "--prompt", PROMPT]
    attnlab += ["--max-new-tokens", "2", "--ignore-eos", "--temperature", "0"]
    attnlab += ["--threads", str(threads)]
    attnlab += ["--device", "cpu"]
    warm_cache = tempfile.mkdtemp(prefix="attnlab-inductor-warm-")
    env = dict(os.environ)
    candidates = {
        "llama.cpp": ([python, "-c", LLAMA, path, str(threads), PROMPT], env),
        "attnlab": (attnlab, env),
        "attnlab --compile warm": (
            [*attnlab, "--compile"],
            {**env, "TORCHINDUCTOR_CACHE_DIR": warm_cache},
        ),
    }
    print(f"start-up: a new process to 2 greedy tokens and exit, {Path(path).name}")
    print(f"CPU: {cpu_name()}; threads: {threads}; rounds {args.rounds}, medians")
    print(isa_header(args.isa))
    for command, e in candidates.values():  # the page cache, the kernels, the warm cache
        run(command, e)
    times = {name: [] for name in candidates}
    for r in range(args.rounds):
        for name, (command, e) in candidates.items():
            times[name].append(run(command, e))
            print(f"   round {r + 1}: {name} {times[name][-1][0]:.2f} s", file=sys.stderr)
    cold = []
    for r in range(args.cold_rounds):
        with tempfile.TemporaryDirectory(prefix="attnlab-inductor-cold-") as empty:
            cold.append(run([*attnlab, "--compile"], {**env, "TORCHINDUCTOR_CACHE_DIR": empty}))
        print(f"   cold {r + 1}: {cold[-1][0]:.1f} s", file=sys.stderr)
    times["attnlab --compile cold"] = cold
    base = [statistics.median(t[i] for t in times["llama.cpp"]) for i in (0, 1)]
    print(f"\n{'process':<24} {'wall s':>8} {'CPU s':>8} {'x llama.cpp w/c':>16}")
    for name, runs in times.items():
        if not runs:
            continue
        wall, cpu = (statistics.median(t[i] for t in runs) for i in (0, 1))
        print(f"{name:<24} {wall:8.2f} {cpu:8.2f} {wall / base[0]:8.2f}/{cpu / base[1]:.2f}")


if __name__ == "__main__":
    main()
