"""The full sampler against its references, on the same logits: transformers' logits processors
(TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TemperatureLogitsWarper,
RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor
for logit_bias) and OpenAI's formula for the presence and frequency penalties, written out
below with Python loops.

Each batch gives every row its own settings (as the server batches requests), and each row must
equal its reference run on that row alone; generation (greedy, where penalties, biases and
min_new_tokens change the argmax) must equal a loop of full forwards through transformers'
processors."""

from dataclasses import replace

import pytest
import torch

from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import (
    SamplingConfig,
    SamplingRows,
    TokenCounts,
    apply_presence_frequency_penalties,
    filter_logits,
    sample,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

pytestmark = pytest.mark.hf
hf = pytest.importorskip("transformers.generation.logits_process")

V = 50
STOPS = (3, 7)

# One config per row: every processor, alone and together, and rows that use none.
ROWS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(min_p=0.1),
    SamplingConfig(repetition_penalty=1.5),
    SamplingConfig(presence_penalty=0.8, frequency_penalty=0.4),
    SamplingConfig(presence_penalty=-1.0, frequency_penalty=-0.5, top_k=12),
    SamplingConfig(logit_bias={4: 100, 9: -100, 11: 2.5}),
    SamplingConfig(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={"2": 5.0, "3": -3.0},
    ),
    SamplingConfig(temperature=0.0, repetition_penalty=0.7, top_k=3),
]


def openai_penalties(logits, generated_ids, presence, frequency):
    """OpenAI's formula with loops: mu[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    out = logits.clone()
    for j in range(out.shape[-1]):
        c = sum(1 for t in generated_ids if t == j)
        out[0, j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def reference_row(logits, cfg, prompt, generated, banned_now, stops=STOPS):
    """transformers' processors (and OpenAI's formula) on one row (1, V), in the order of
    attnlab/inference/sampling.py's docstring."""
    ids = torch.tensor([prompt + generated])
    out = logits.clone()
    if cfg.logit_bias:
        bias = [[[token], value] for token, value in cfg.logit_bias]
        out = hf.SequenceBiasLogitsProcessor(bias)(ids, out)
    if banned_now:
        ban = hf.MinNewTokensLengthLogitsProcessor(len(prompt), len(generated) + 1, list(stops))
        out = ban(ids, out)
    if cfg.repetition_penalty != 1:
        out = hf.RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty)(ids, out)
    if cfg.presence_penalty or cfg.frequency_penalty:
        out = openai_penalties(out, generated, cfg.presence_penalty, cfg.frequency_penalty)
    if cfg.temperature > 0:
        out = hf.TemperatureLogitsWarper(cfg.temperature)(ids, out)
    if cfg.top_k is not None:
        out = hf.TopKLogitsWarper(cfg.top_k)(ids, out)
    if cfg.top_p is not None:
        out = hf.TopPLogitsWarper(cfg.top_p)(ids, out)
    if cfg.min_p:
        out = hf.MinPLogitsWarper(cfg.min_p)(ids, out)
    return out


def batch(seed):
    """Logits (B, V), a prompt and some generated tokens per row (with repeats)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), V, generator=g) * 3
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in ROWS]
    generated = [torch.randint(0, V // 4, (5,), generator=g).tolist() for _ in ROWS]
    return logits, prompts, generated


def counts_of(prompts, generated):
    counts = TokenCounts.of_prompts(torch.tensor(prompts), V)
    for step in range(len(generated[0])):
        counts.add(torch.tensor([row[step] for row in generated]))
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("banned", [False, True])
def test_each_row_of_a_mixed_batch_equals_transformers_on_that_row(seed, banned):
    logits, prompts, generated = batch(seed)
    rows = SamplingRows.stack(ROWS, V, "cpu")
    mask = torch.zeros(V, dtype=torch.bool)
    mask[list(STOPS)] = True
    got = filter_logits(logits, rows, counts_of(prompts, generated), mask if banned else None)
    for b, cfg in enumerate(ROWS):
        want = reference_row(logits[b : b + 1], cfg, prompts[b], generated[b], banned)
        torch.testing.assert_close(got[b : b + 1], want, msg=f"row {b}: {cfg}")


def test_the_presence_and_frequency_penalties_are_openais_formula():
    logits, prompts, generated = batch(5)
    counts = counts_of(prompts, generated)
    got = apply_presence_frequency_penalties(logits, counts.generated, 0.6, 1.1)
    for b in range(len(ROWS)):
        want = openai_penalties(logits[b : b + 1], generated[b], 0.6, 1.1)
        torch.testing.assert_close(got[b : b + 1], want)
    # The prompt's tokens do not count: a token only in the prompt keeps its logit.
    only_prompt = set(prompts[0]) - set(generated[0])
    for j in only_prompt:
        assert got[0, j] == logits[0, j]


def test_greedy_and_sampled_rows_in_one_batch():
    """Greedy rows take the argmax of their processed logits; the sampled ones draw."""
    logits, prompts, generated = batch(3)
    counts = counts_of(prompts, generated)
    rows = SamplingRows.stack(ROWS, V, "cpu")
    token = sample(logits, rows, counts, torch.Generator().manual_seed(0))
    greedy = [b for b, cfg in enumerate(ROWS) if cfg.temperature == 0]
    processed = filter_logits(logits, rows, counts)
    for b in greedy:
        assert token[b] == processed[b].argmax()
    assert all(torch.isfinite(processed[b, token[b]]) for b in range(len(ROWS)))


# --- generation: greedy, where the penalties, the bias and min_new_tokens change the argmax ----
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), d_model=32, n_layers=1, d_ff=64, vocab_size=V)
    return build_model(cfg).eval()


def hf_greedy(model, prompt, cfg, n, min_new, stops=STOPS):
    """Greedy decoding by full forwards (no cache), each step's logits through transformers'
    processors (reference_row) with the stop tokens banned before min_new tokens."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out]))[0, -1:].float()  # (1, V)
            processed = reference_row(logits, cfg, prompt, out, len(out) < min_new, stops)
            token = int(processed.argmax())
            out.append(token)
            if token in stops:
                break
    return out


GREEDY = [
    SamplingConfig(temperature=0, repetition_penalty=2.0),
    SamplingConfig(temperature=0, presence_penalty=1.5, frequency_penalty=2.0),
    SamplingConfig(temperature=0, logit_bias={5: 4.0, 6: 3.0}),
    SamplingConfig(temperature=0, repetition_penalty=0.5, frequency_penalty=-2.0),
]


@pytest.mark.parametrize("cfg", GREEDY, ids=["repetition", "presence+frequency", "bias", "neg"])
def test_generate_equals_a_loop_through_transformers_processors(tiny_model, cfg):
    prompts = [[1, 2, 3, 4], [9, 9, 8]]
    got = generate(tiny_model, prompts, GenerationConfig(12, cfg, stop_tokens=STOPS))
    for prompt, row in zip(prompts, got):
        assert row == hf_greedy(tiny_model, prompt, cfg, 12, 0)
    plain = [hf_greedy(tiny_model, p, SamplingConfig(temperature=0), 12, 0) for p in prompts]
    assert got != plain, "the setting changes the output (so the comparison means something)"


def test_min_new_tokens_bans_the_stop_tokens_until_then(tiny_model):
    # The stop tokens are the ones greedy decoding would choose first, so the ban matters.
    prompt = [1, 2, 3, 4]
    plain = generate(tiny_model, [prompt], GenerationConfig(12, SamplingConfig(temperature=0)))[0]
    stops = (plain[0], plain[1])
    cfg = SamplingConfig(temperature=0)
    config = GenerationConfig(12, cfg, stop_tokens=stops, min_new_tokens=5)
    got = generate(tiny_model, [prompt], config)[0]
    assert got == hf_greedy(tiny_model, prompt, cfg, 12, 5, stops)
    assert len(got) > 5 and not set(got[:5]) & set(stops)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2.0, 2.0]"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2.0, 2.0]"),
        ("logit_bias", {5: 101}, "logit_bias[5] must be in [-100, 100]"),
        ("logit_bias", {"x": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {-1: 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {1: "a"}, "logit_bias[1] must be a number"),
    ],
)
def test_bad_values_raise_naming_the_field(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingConfig(**{field: value})


def test_a_bias_outside_the_vocabulary_is_named():
    with pytest.raises(ValueError, match=f"logit_bias key {V} is outside the vocabulary"):
        SamplingRows.stack([SamplingConfig(logit_bias={V: 1.0})], V, "cpu")


def test_min_new_tokens_beyond_max_new_tokens_is_refused():
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        GenerationConfig(4, min_new_tokens=5)


def test_beam_search_ends_no_hypothesis_before_min_new_tokens(tiny_model):
    """As transformers' MinNewTokensLengthLogitsProcessor in beam search: the stop tokens (here
    the likeliest first tokens, so the ban matters) are banned for the first tokens."""
    prompt = [1, 2, 3, 4]
    logits = tiny_model(torch.tensor([prompt]))[0, -1]
    stops = tuple(logits.topk(5).indices.tolist())
    config = GenerationConfig(8, stop_tokens=stops, num_beams=3, num_return_sequences=3)
    ended_early = beam_search(tiny_model, [prompt], config)[0]
    assert any(len(h.tokens) < 4 for h in ended_early)
    kept = beam_search(tiny_model, [prompt], replace(config, min_new_tokens=4))[0]
    assert all(len(h.tokens) >= 4 and not set(h.tokens[:4]) & set(stops) for h in kept)
