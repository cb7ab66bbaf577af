"""Valid JSON from SmolLM2-135M-Instruct with and without the constraint, and what it costs.

    .venv/bin/python benchmarks/json_validity.py            # 50 prompts, ~3 min on 2 cores
    .venv/bin/python benchmarks/json_validity.py --n 10     # a smoke run

50 chat prompts ask for a JSON object about a person (a schema with a string name, an integer
age and a string city, all required); each is answered greedily, up to --max-new-tokens, in one
batch: once free, once constrained to the schema (`Constraint.json_schema`, llguidance). A reply
counts as valid when `json.loads` reads it and `jsonschema` accepts it (for the free replies,
the first {...} in the text, so that prose or a code fence around the object does not count
against it). Time: the two batches alternate (free, constrained, free, constrained), medians;
a batch runs until its last row stops, so the constrained batch's extra time per step (every
row's mask, computed on the host) is the constraint's cost.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

import jsonschema
import torch
from _timing import cpu_name

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.config import GenerationConfig
from attnlab.inference.constraints import Constraint
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired teacher",
    "a young painter",
    "a fisherman",
    "a nurse",
    "a chess champion",
    "a baker",
    "a pilot",
    "a librarian",
    "a marathon runner",
    "a violinist",
]
CITIES = ["Lisbon", "Osaka", "Nairobi", "Lima", "Oslo"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        who, city = PEOPLE[i % len(PEOPLE)], CITIES[(i // len(PEOPLE)) % len(CITIES)]
        ask = (
            f"Invent {who} who lives in {city}. Reply with only a JSON object with the keys "
            f'"name" (a string), "age" (an integer) and "city" (a string).'
        )
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}])
        out.append(tokenizer.encode(text))
    return out


def valid(text: str) -> bool:
    match = re.search(r"\{.*\}", text, re.S)
    try:
        jsonschema.validate(json.loads(match.group(0) if match else text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="prompts (default 50)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path}: not found; run `attnlab download smollm2-135m-instruct` first")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    loaded = open_checkpoint(path)
    tok = loaded.tokenizer
    stops = [
        tok.token_id(t) for t in ("<|im_end|>", "<|endoftext|>") if tok.token_id(t) is not None
    ]
    ids = prompts(tok, args.n)
    greedy = SamplingConfig(temperature=0.0)
    configs = {
        "free": GenerationConfig(args.max_new_tokens, greedy, stop_tokens=stops),
        "constrained": GenerationConfig(
            args.max_new_tokens,
            greedy,
            stop_tokens=stops,
            constraint=Constraint.json_schema(SCHEMA),
        ),
    }
    times, texts, tokens = {k: [] for k in configs}, {}, {}
    for _ in range(args.rounds):
        for name, config in configs.items():
            start = time.perf_counter()
            out = generate(loaded.model, ids, config, tokenizer=tok)
            times[name].append(time.perf_counter() - start)
            texts[name] = [tok.decode([t for t in row if t not in stops]) for row in out]
            tokens[name] = (sum(len(row) for row in out), max(len(row) for row in out))
    print(
        f"SmolLM2-135M-Instruct, {args.n} prompts, greedy, up to {args.max_new_tokens} new tokens"
    )
    print(f"CPU: {cpu_name()}; threads {torch.get_num_threads()}; rounds {args.rounds}, medians")
    print(f"{'':<12}{'valid JSON':>11}{'tokens':>8}{'steps':>7}{'seconds':>9}{'ms/step':>9}")
    per_step = {}
    for name in configs:
        ok = sum(valid(t) for t in texts[name])
        seconds = statistics.median(times[name])
        n_tokens, steps = tokens[name]
        per_step[name] = seconds / steps * 1e3
        print(
            f"{name:<12}{ok:>6}/{args.n:<4}{n_tokens:>8}{steps:>7}{seconds:>9.1f}"
            f"{per_step[name]:>9.1f}"
        )
    extra = per_step["constrained"] - per_step["free"]
    print(
        f"constraint's cost: {extra:+.1f} ms per batched step of {args.n} rows "
        f"({extra / args.n:+.2f} ms per row and step)"
    )
    bad = [t for t in texts["constrained"] if not valid(t)]
    if bad:
        print("an invalid constrained reply:", json.dumps(bad[0][:160]))
    print("first free reply:", json.dumps(texts["free"][0][:160]))
    print("first constrained reply:", json.dumps(texts["constrained"][0][:160]))


if __name__ == "__main__":
    main()
