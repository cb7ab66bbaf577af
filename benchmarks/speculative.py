"""Speculative decoding on SmolLM2-135M-Instruct: acceptance rate and speed against plain decoding.

    .venv/bin/python benchmarks/speculative.py                 # 4 code prompts, 64 tokens, 5 rounds
    .venv/bin/python benchmarks/speculative.py --quick         # 2 prompts, 24 tokens, 2 rounds
    .venv/bin/python benchmarks/speculative.py --k 2 4 8       # drafts per round to compare

The model is the GGUF file's fp32 dequantization (`open_checkpoint(path)`), batch 1, greedy, on
code-continuation prompts (PROMPTS). Variants, each `generate(..., speculative=...)`:

  plain fp32      one decode step per token: the reference every ratio divides by
  ngram K         prompt lookup (NgramDrafter, n = 3..1): no second model
  int4 draft K    the same file opened with scheme="int4" (its Q4_1 matrices kept as
                  Int4Linear) drafting for its fp32 self (ModelDrafter)
  plain int4      the drafter decoding on its own: what one draft token costs

Time: every variant generates once per prompt per round, interleaved (prompt 1: A B C D,
prompt 2: A B C D, ...), after one warm-up round; a variant's tokens/s in a round is its new
tokens over its wall time on all prompts (prefill included); the table gives the median over
rounds, and the speedup is the median over rounds of that round's ratio to plain fp32 (a noisy
neighbour slows both sides of a ratio alike). Acceptance = accepted / drafted tokens over all
prompts (greedy: the same in every round). "same" checks each output against plain fp32's.
Last, the cost of a verification: one forward of k+1 tokens against the cache, next to a
one-token decode step (k = 0), interleaved.
"""

import os

# As benchmarks/decode.py: on a loaded machine, sleep at OpenMP barriers instead of spinning.
if os.getloadavg()[0] >= len(os.sched_getaffinity(0)):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _timing import cpu_name, interleaved, median_ms, use_all_cores  # noqa: E402

from attnlab.checkpoint import open_checkpoint  # noqa: E402
from attnlab.inference.config import GenerationConfig  # noqa: E402
from attnlab.inference.generate import generate  # noqa: E402
from attnlab.inference.sampling import SamplingConfig  # noqa: E402
from attnlab.inference.speculative import (  # noqa: E402
    ModelDrafter,
    NgramDrafter,
    Speculative,
    SpeculativeStats,
)
from attnlab.inference.steps import fill_cache  # noqa: E402

GGUF = Path.home() / ".cache/attnlab/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = {
    "fibonacci": "def fibonacci(n):\n    ",
    "point class": (
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def __add__(self, other):\n        return Point(self.x + other.x, self.y + other.y)"
        "\n\n    def __sub__(self, other):\n"
    ),
    "statistics": (
        'def mean(values):\n    """Return the arithmetic mean of values."""\n'
        "    return sum(values) / len(values)\n\n\n"
        'def variance(values):\n    """Return the variance of values."""\n'
    ),
    "tests": (
        "def test_add():\n    assert add(1, 2) == 3\n\n\ndef test_sub():\n"
        "    assert sub(3, 2) == 1\n\n\ndef test_mul():\n"
    ),
}


def variants(fp32, int4, ks: list[int]) -> dict:
    """name -> (model, Speculative or None)."""
    out = {"plain fp32": (fp32, None)}
    for k in ks:
        out[f"ngram K={k}"] = (fp32, Speculative(NgramDrafter(), k))
        out[f"int4 draft K={k}"] = (fp32, Speculative(ModelDrafter(int4), k))
    out["plain int4"] = (int4, None)
    return out


def run_round(cases: dict, prompts: dict, config: GenerationConfig) -> dict:
    """One round: each prompt through every variant in turn.

    Returns:
        name -> (seconds, outputs, {prompt: (drafted, accepted)}).
    """
    result = {name: [0.0, [], {}] for name in cases}
    for prompt, ids in prompts.items():
        for name, (model, spec) in cases.items():
            before = (spec.stats.drafted, spec.stats.accepted) if spec else (0, 0)
            start = time.perf_counter()
            out = generate(model, [ids], config, speculative=spec)[0]
            result[name][0] += time.perf_counter() - start
            result[name][1].append(out)
            if spec is not None:
                drafted, accepted = spec.stats.drafted, spec.stats.accepted
                result[name][2][prompt] = (drafted - before[0], accepted - before[1])
    return result


def forward_costs(model, ids: list[int], ks: list[int], rounds: int = 15) -> dict[int, float]:
    """Median ms of one forward of k+1 tokens against a cache holding `ids` (k = 0: a plain
    decode step), the sizes interleaved: what verifying K drafts costs next to one token."""
    prompt = torch.tensor([ids])
    _, cache, slot = fill_cache(model, prompt, torch.ones_like(prompt, dtype=bool), max(ks) + 1)
    fns = {
        k: partial(
            model,
            prompt[:, -1:].expand(1, k + 1),
            cache=cache,
            slots=torch.arange(slot, slot + k + 1),
        )
        for k in [0, *ks]
    }
    with torch.no_grad():
        times = interleaved(fns, rounds)
    return {k: median_ms(t) for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default=str(GGUF), help="SmolLM2's GGUF (default %(default)s)")
    parser.add_argument("--k", nargs="+", type=int, default=[4], help="drafts per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, 2 rounds")
    args = parser.parse_args()
    prompts = dict(list(PROMPTS.items())[:2]) if args.quick else PROMPTS
    n_new, rounds = (24, 2) if args.quick else (args.new_tokens, args.rounds)
    threads = use_all_cores()
    print(
        f"attnlab speculative decoding: torch {torch.__version__}, {threads} threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average "
        f"{os.getloadavg()[0]:.1f} at start), {cpu_name()}, {platform.system()} "
        f"{platform.release()}"
    )
    print(f"model: {args.ckpt} (fp32 dequantized; drafter: its Q4_1 matrices as Int4Linear)")
    print(f"{len(prompts)} code prompts, {n_new} new tokens each, greedy, batch 1, {rounds} rounds")
    fp32, tokenizer = (loaded := open_checkpoint(args.ckpt)).model, loaded.tokenizer
    int4 = open_checkpoint(args.ckpt, scheme="int4").model
    ids = {name: tokenizer.encode(text) for name, text in prompts.items()}
    cases = variants(fp32, int4, args.k)
    config = GenerationConfig(n_new, SamplingConfig(temperature=0.0))
    run_round(cases, ids, config)  # warm-up
    for _, spec in cases.values():
        if spec is not None:
            spec.stats = SpeculativeStats()  # count the timed rounds only
    per_round = []
    for i in range(rounds):
        per_round.append(run_round(cases, ids, config))
        print(f"round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    report(cases, per_round, len(ids), n_new)
    costs = forward_costs(fp32, ids[next(iter(ids))], args.k)
    print()
    print("one fp32 forward of k+1 tokens against the cache (median ms, interleaved, 15 rounds):")
    print("  " + ", ".join(f"k={k}: {ms:.1f} ms ({ms / costs[0]:.2f}x)" for k, ms in costs.items()))


def report(cases: dict, per_round: list[dict], n_prompts: int, n_new: int) -> None:
    tokens = n_new * n_prompts
    reference = per_round[0]["plain fp32"][1]
    print()
    print(f"{'variant':<18} {'tok/s':>7} {'speedup':>8} {'accepted':>9} {'tok/fwd':>8}  same")
    for name, (_, spec) in cases.items():
        rates = [tokens / r[name][0] for r in per_round]
        ratios = [r["plain fp32"][0] / r[name][0] for r in per_round]
        same = all(r[name][1] == reference for r in per_round)
        accepted, per_forward = "-", "1.00"
        if spec is not None:
            s = spec.stats
            accepted = f"{s.acceptance_rate:.1%}"
            per_forward = f"{(s.tokens - len(per_round) * n_prompts) / s.rounds:.2f}"
        print(
            f"{name:<18} {statistics.median(rates):>7.1f} {statistics.median(ratios):>7.2f}x "
            f"{accepted:>9} {per_forward:>8}  {'yes' if same else 'NO'}"
        )
    print()
    print("tok/s: median over rounds; speedup: median over rounds of plain fp32's time / the")
    print("variant's; tok/fwd: tokens per verification forward (the first token, from the")
    print("prefill, left out); same: every output equals plain fp32's, token for token")
    print()
    print("acceptance per prompt (greedy: the same every round):")
    for name, (_, spec) in cases.items():
        if spec is not None:
            counts = per_round[0][name][2]
            parts = [f"{p} {a}/{d}" for p, (d, a) in counts.items()]
            print(f"  {name}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
