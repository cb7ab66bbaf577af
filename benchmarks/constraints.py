"""Constrained decoding: the cost of a token mask, llguidance (attnlab's Matcher) against
outlines-core, on byte-level BPE vocabularies (docs/generation.md, "Constrained decoding").

    PYTHONPATH=. .venv/bin/python benchmarks/constraints.py

For a regex and a JSON schema (tests/inference/test_constraints.py's), on the tiny test
tokenizer (296 tokens) and SmolLM2's (49,152; from its GGUF in attnlab's cache, skipped when
absent): the time to compile the constraint for the vocabulary, and the median time of one
step's mask along a random walk of allowed tokens (llguidance: the library's own mask, and
attnlab's `Matcher.mask`, which makes it a (V,) bool tensor). outlines-core takes the schema as
the regex its own `build_regex_from_schema` writes. One thread, medians of <= 60 steps.
"""

import json
import random
import statistics
import time

import outlines_core
import torch

from attnlab.inference.constraints import Constraint, Matcher, vocabulary
from attnlab.tokenizer import CHAT_TOKENS, train_bpe_tokenizer
from tests.inference.test_constraints import REGEX, SCHEMA, TEXT
from tests.realmodel import SMOLLM2_DIR, SMOLLM2_FILE, cache_root

STEPS = 60


def tokenizers() -> dict:
    found = {"tiny BPE": train_bpe_tokenizer([TEXT], 320, CHAT_TOKENS)}
    gguf = cache_root() / SMOLLM2_DIR / SMOLLM2_FILE
    if gguf.exists():
        from attnlab.interop.gguf.reader import metadata, open_reader
        from attnlab.interop.gguf.tokenizer import tokenizer_from_metadata

        found["SmolLM2"] = tokenizer_from_metadata(metadata(open_reader(gguf)), str(gguf))
    return found


def clock(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def llguidance_walk(tok, constraint: Constraint) -> tuple[float, float, float]:
    """(compile s, library mask s, Matcher.mask s) along a random walk."""
    eos, rng = tok.token_id("<eos>"), random.Random(0)
    vocabulary(tok)  # built once per tokenizer, not per constraint
    m, built = clock(lambda: Matcher(constraint, tok, [eos], tok.vocab_size))
    raw, full = [], []
    for _ in range(STEPS):
        raw.append(clock(m.matcher.compute_logit_bias)[1])
        mask, seconds = clock(m.mask)
        full.append(seconds)
        token = rng.choice(mask.nonzero().flatten().tolist())
        if token == eos:
            break
        m.advance(token)
    return built, statistics.median(raw), statistics.median(full)


def outlines_walk(tok, regex: str) -> tuple[float, float]:
    """(compile s, mask s) of outlines-core's Index and Guide, on the same token bytes."""
    eos, rng, lt = tok.token_id("<eos>"), random.Random(0), vocabulary(tok)
    words: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if not lt.is_special_token(i):
            words.setdefault(lt.decode_bytes([i]), []).append(i)
    vocab = outlines_core.Vocabulary(eos, words)
    guide, built = clock(lambda: outlines_core.Guide(outlines_core.Index(regex, vocab)))
    bits = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(STEPS):
        times.append(clock(lambda: guide.write_mask_into(bits.data_ptr(), bits.numel(), 4))[1])
        token = rng.choice(guide.get_tokens())
        if token == eos or guide.is_finished():
            break
        guide.advance(token)
    return built, statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    schema_regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    cases = [
        ("regex", Constraint.regex(REGEX), REGEX),
        ("json schema", Constraint.json_schema(SCHEMA), schema_regex),
    ]
    print(
        "| vocabulary | constraint | llguidance compile | mask (library) | Matcher.mask "
        "| outlines-core compile | mask |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, tok in tokenizers().items():
        for kind, constraint, regex in cases:
            built, raw, full = llguidance_walk(tok, constraint)
            o_built, o_mask = outlines_walk(tok, regex)
            print(
                f"| {name} ({tok.vocab_size}) | {kind} | {built * 1e3:.1f} ms "
                f"| {raw * 1e6:.0f} us | {full * 1e6:.0f} us "
                f"| {o_built * 1e3:.1f} ms | {o_mask * 1e6:.1f} us |"
            )


if __name__ == "__main__":
    main()
