"""Sampling filters against their definitions, the CTRL repetition penalty against transformers,
greedy as the temperature -> 0 limit, seeding, and SamplingConfig validation.

    top-k  (Fan et al. 2018):       keep the k most likely tokens
    top-p  (Holtzman et al. 2020):  keep the smallest most-likely set with mass >= p
    min-p  (Nguyen et al. 2024):    keep tokens with probability >= min_p * max probability
    penalty (Keskar et al. 2019):   seen token: logit / r if logit > 0, logit * r otherwise
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import (
    SamplingConfig,
    TokenCounts,
    apply_repetition_penalty,
    filter_logits,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
SHIFTS = [0.0, -7.0, 3.0, 11.5]  # softmax ignores a constant added to every logit
PROPERTY = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def kept(filtered: torch.Tensor) -> list[int]:
    """Indices a filter left finite, for a (1, V) row."""
    return torch.isfinite(filtered[0]).nonzero().flatten().tolist()


def crafted(shift: float) -> torch.Tensor:
    return torch.tensor([PROBS]).log() + shift  # (1, 5)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.7, [0, 1]),
        (0.71, [0, 1, 2]),
        (0.5, [0]),
        (0.3, [0]),
        (0.85, [0, 1, 2]),
        (0.96, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected, shift):
    # 0.5 + 0.2 = 0.7 reaches p = 0.7 exactly: two tokens; p = 0.71 needs the third.
    assert kept(top_p_filter(crafted(shift), top_p)) == expected


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.3, [0, 1, 2]), (0.4, [0, 1]), (0.2, [0, 1, 2, 3]), (0.05, [0, 1, 2, 3, 4]), (1.0, [0])],
)
def test_min_p_keeps_tokens_at_least_min_p_times_the_top(min_p, expected, shift):
    # min_p = 0.3: threshold 0.3 * 0.5 = 0.15, and 0.15 itself is kept.
    assert kept(min_p_filter(crafted(shift), min_p)) == expected


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("k", [1, 2, 4, 5, 9])
def test_top_k_keeps_the_k_most_likely(k, shift):
    assert kept(top_k_filter(crafted(shift), k)) == list(range(min(k, len(PROBS))))


@st.composite
def distributions(draw):
    """Distinct logits (no ties, so each definition names one set) and a seeded batch."""
    V = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**16))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (logits * draw(st.sampled_from([0.5, 2.0, 5.0]))).float()


@PROPERTY
@given(
    logits=distributions(),
    p=st.floats(0.05, 0.99),
    min_p=st.floats(0.01, 1.0),
    k=st.integers(1, 12),
)
def test_filters_equal_their_definitions_on_random_distributions(logits, p, min_p, k):
    probs = torch.softmax(logits.double(), dim=-1)  # the definitions, in float64
    for row in range(logits.shape[0]):
        pr = probs[row].tolist()
        order = sorted(range(len(pr)), key=lambda i: -pr[i])
        # top-k: the k largest.
        assert sorted(kept(top_k_filter(logits[row : row + 1], k))) == sorted(order[:k])
        # top-p: the shortest prefix of the sorted order whose mass reaches p.
        mass, n = 0.0, 0
        while mass < p:
            mass, n = mass + pr[order[n]], n + 1
        if abs(mass - pr[order[n - 1]] - p) > 1e-4 and abs(mass - p) > 1e-4:  # not at a boundary
            assert sorted(kept(top_p_filter(logits[row : row + 1], p))) == sorted(order[:n])
        # min-p: probability at least min_p times the largest.
        threshold = min_p * max(pr)
        if all(abs(q - threshold) > 1e-6 for q in pr):
            want = [i for i, q in enumerate(pr) if q >= threshold]
            assert kept(min_p_filter(logits[row : row + 1], min_p)) == want


def test_filtered_distribution_is_the_renormalised_restriction():
    """Sampling from the filtered logits = drawing from the kept tokens in proportion to p."""
    logits = crafted(0.0)
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    q = torch.softmax(filter_logits(logits, cfg), dim=-1)[0]
    p = torch.tensor(PROBS)
    expected = torch.where(torch.arange(5) < 3, p, 0.0) / p[:3].sum()
    torch.testing.assert_close(q, expected)
    # And the draw follows it: 20k rows in one call, each frequency within 1.5 percentage points.
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(20_000, -1), cfg, generator=gen)
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_divides_the_logits(temperature):
    """softmax(logits / T): probabilities proportional to p ** (1 / T)."""
    q = torch.softmax(filter_logits(crafted(0.0), SamplingConfig(temperature=temperature)), -1)
    p = torch.tensor(PROBS, dtype=torch.float64) ** (1 / temperature)
    torch.testing.assert_close(q[0].double(), p / p.sum(), atol=1e-6, rtol=0)


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    previous = torch.tensor([[0, 1, 3, 0]])  # repeated ids are penalised once
    got = apply_repetition_penalty(logits, TokenCounts.of_prompts(previous, 4).seen, 2.0)
    assert got.tolist() == [[1.0, -2.0, 0.5, 0.0]]


@pytest.mark.hf
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g) * 3
    previous = torch.randint(0, 30, (4, 12), generator=g)  # with repeats
    ref = RepetitionPenaltyLogitsProcessor(penalty)(previous, logits.clone())
    seen = TokenCounts.of_prompts(previous, 30)
    torch.testing.assert_close(apply_repetition_penalty(logits, seen.seen, penalty), ref)
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=penalty)
    torch.testing.assert_close(filter_logits(logits, cfg, seen), ref)


def test_temperature_zero_is_greedy_and_small_temperatures_approach_it():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 2
    greedy = logits.argmax(-1)
    assert sample(logits, SamplingConfig(temperature=0.0)).tolist() == greedy.tolist()
    gen = torch.Generator().manual_seed(0)
    for t in (1e-3, 1e-5):
        for _ in range(5):
            assert sample(logits, SamplingConfig(temperature=t), generator=gen).equal(greedy)
    # Filters leave the top token in place, so greedy with filters is still the argmax.
    cfg = SamplingConfig(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    assert sample(logits, cfg).equal(greedy)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), d_model=32, n_layers=1, d_ff=64, vocab_size=40)
    return build_model(cfg).eval()


def test_same_seed_same_tokens_different_seed_different_tokens(tiny_model):
    prompts, cfg = [[1, 2, 3], [4, 5]], SamplingConfig(temperature=1.0)
    a = generate(tiny_model, prompts, GenerationConfig(10, cfg, seed=7))
    torch.manual_seed(123)  # the global RNG plays no part once a seed is given
    b = generate(tiny_model, prompts, GenerationConfig(10, cfg, seed=7))
    c = generate(tiny_model, prompts, GenerationConfig(10, cfg, seed=8))
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("temperature", -0.5),
        ("top_k", 0),
        ("top_k", -3),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_bad_sampling_values_raise_naming_the_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingConfig(**{field: value})
    assert field in str(err.value) and str(value) in str(err.value)
