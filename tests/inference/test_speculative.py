"""Speculative decoding (inference/speculative.py) against its two references: plain decoding
(greedy output token for token) and the target distribution itself (sampled output; Leviathan et
al. 2023, Theorem 1), checked by chi-square tests at fixed seeds on a tiny vocabulary."""

import copy
from dataclasses import replace

import pytest
import torch

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig, token_distribution
from attnlab.inference.speculative import (
    ModelDrafter,
    NgramDrafter,
    Speculative,
    accept_drafts,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize.handler import quantize_model

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = ([1, 2, 3, 4, 1, 2], [5, 5, 5], list(range(10, 30)))
# chi-square critical values at p = 0.001 (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 15: 37.70}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(preset: str, seed: int = 0, vocab: int = 97):
    torch.manual_seed(seed)
    cfg = replace(get_preset(preset), d_model=64, n_layers=2, vocab_size=vocab, max_seq_len=64)
    return build_model(cfg).eval()


def int4_copy(model):
    draft = copy.deepcopy(model)
    quantize_model(draft, "int4")
    return draft


DRAFTERS = {
    "ngram": lambda model: NgramDrafter(),
    "int4-self": lambda model: ModelDrafter(int4_copy(model)),
    # another random model: mostly wrong drafts, so the cache is rolled back at most rounds
    "other-model": lambda model: ModelDrafter(tiny("llama-tiny", seed=1)),
}


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_output_is_plain_decodings_token_for_token(preset, drafter):
    model = tiny(preset)
    config = GenerationConfig(16, GREEDY)
    spec = Speculative(DRAFTERS[drafter](model), num_draft_tokens=3)
    for prompt in PROMPTS:
        assert generate(model, [prompt], config, speculative=spec) == generate(
            model, [prompt], config
        )
    assert spec.stats.tokens == 16 * len(PROMPTS)
    assert 0 <= spec.stats.accepted <= spec.stats.drafted


def test_rejections_happen_and_are_counted():
    """The other-model drafter is wrong often: the equality above did exercise the rollback."""
    model = tiny("llama-tiny")
    spec = Speculative(ModelDrafter(tiny("llama-tiny", seed=1)), num_draft_tokens=3)
    generate(model, [PROMPTS[2]], GenerationConfig(24, GREEDY), speculative=spec)
    assert spec.stats.accepted < spec.stats.drafted
    assert spec.stats.tokens == 24 == spec.stats.rounds + spec.stats.accepted + 1


def test_greedy_with_penalties_stop_tokens_and_min_new_tokens():
    """The penalties count each position's own drafts; a stop token ends both alike, and is
    banned at each position before min_new_tokens."""
    model = tiny("llama-tiny")
    plain = generate(model, [PROMPTS[0]], GenerationConfig(30, GREEDY))[0]
    penalties = replace(GREEDY, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    configs = [
        GenerationConfig(30, replace(penalties, logit_bias={plain[3]: 2.0})),
        GenerationConfig(30, GREEDY, stop_tokens=[plain[10]]),
        # banned for 3 tokens, this stop token comes right after: inside the first round
        GenerationConfig(30, GREEDY, stop_tokens=[plain[1]], min_new_tokens=3),
    ]
    for config in configs:
        want = generate(model, [PROMPTS[0]], config)
        for drafter in (NgramDrafter(), ModelDrafter(model)):  # the model: every draft kept
            spec = Speculative(drafter, num_draft_tokens=4)
            assert generate(model, [PROMPTS[0]], config, speculative=spec) == want
    assert len(generate(model, [PROMPTS[0]], configs[1])[0]) <= 11  # stopped early
    assert len(want[0]) == 4  # (the last config's) the stop token as soon as it is allowed


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(max_ngram=2)
    text = torch.tensor([[7, 1, 2, 3, 9, 1, 2, 4, 5, 8, 2]])
    # the bigram (8, 2) never occurred before; the unigram 2 last did at index 6: 4, 5 follow
    assert drafter.propose(text, 3, GREEDY)[0].tolist() == [4, 5, 8]
    text = torch.tensor([[1, 2, 3, 1, 2, 6, 6, 1, 2]])
    assert drafter.propose(text, 2, GREEDY)[0].tolist() == [6, 6]  # latest (1, 2) wins
    assert drafter.propose(torch.tensor([[1, 2, 3]]), 2, GREEDY)[0].tolist() == []


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_acceptance_rule_keeps_the_target_distribution():
    """Two drafts from a drafter q far from the target p, where p and q of the second position
    depend on the first draft (as a model's would): the first two emitted tokens must be
    distributed as p1(a) p2(b | a), whatever q; 200k rounds at a fixed seed."""
    V, N = 4, 200_000
    g = torch.Generator().manual_seed(0)
    p1, q1 = torch.softmax(torch.randn(V, generator=g), 0), torch.softmax(torch.randn(V) * 2, 0)
    p2 = torch.softmax(torch.randn(V, V, generator=g), 1)  # p2[a] = p(. | a)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 2, 1)
    p3 = torch.softmax(torch.randn(V, V, V, generator=g), 2)
    d1 = torch.multinomial(q1, N, replacement=True, generator=g)  # (N,)
    d2 = torch.multinomial(q2[d1], 1, generator=g)[:, 0]
    p = torch.stack([p1.expand(N, V), p2[d1], p3[d1, d2]], 1)  # (N, 3, V)
    q = torch.stack([q1.expand(N, V), q2[d1]], 1)  # (N, 2, V)
    drafts = torch.stack([d1, d2], 1)
    accepted, token = accept_drafts(p, q, drafts, g)
    first = torch.where(accepted >= 1, d1, token)
    # the second token: d2 if both were kept, the correction if only d1 was (rounds that
    # rejected d1 emitted one token; their second comes from a later round, not counted here)
    kept1 = accepted >= 1
    second = torch.where(accepted == 2, d2, token)[kept1]
    assert chi_square(torch.bincount(first, minlength=V).float(), p1) < CHI2_999[3]
    joint = torch.bincount(d1[kept1] * V + second, minlength=V * V).float()
    # given the first emitted token a came from an accepted draft, the second is p2(. | a)
    want = (torch.bincount(d1[kept1], minlength=V).float()[:, None] * p2).flatten()
    assert chi_square(joint, want / want.sum()) < CHI2_999[15]
    assert 0.2 < kept1.float().mean() < 0.95  # q is far from p: both branches well exercised


def test_acceptance_rule_is_greedy_on_one_hot_distributions():
    p = torch.nn.functional.one_hot(torch.tensor([[3, 1, 2]]), 5).float()  # argmaxes 3, 1, 2
    q = torch.nn.functional.one_hot(torch.tensor([[3, 0]]), 5).float()
    accepted, token = accept_drafts(p, q, torch.tensor([[3, 0]]))
    assert accepted.tolist() == [1] and token.tolist() == [1]  # 0 != 1: the argmax instead
    accepted, token = accept_drafts(p, p[:, :2], torch.tensor([[3, 1]]))
    assert accepted.tolist() == [2] and token.tolist() == [2]  # all kept, then the bonus


@pytest.mark.slow
def test_sampled_generation_keeps_the_models_distribution():
    """End to end, through the models: the second token of 300 seeded generations (an int4
    drafter at temperature 0.7 with top-k 3) against its exact distribution under the model,
    sum over a of p(a | prompt) p(b | prompt, a)."""
    V, prompt = 4, [1, 2, 3]
    model = tiny("llama-tiny", vocab=V)
    spec = Speculative(ModelDrafter(int4_copy(model)), num_draft_tokens=2)
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    counts = torch.zeros(V)
    for seed in range(300):
        out = generate(model, [prompt], GenerationConfig(3, sampling, seed=seed), speculative=spec)
        counts[out[0][1]] += 1
    with torch.no_grad():
        first = token_distribution(model(torch.tensor([prompt]))[:, -1], sampling)[0]  # (V,)
        rows = torch.tensor([prompt + [a] for a in range(V)])
        second = token_distribution(model(rows)[:, -1], sampling)  # (V, V): p(b | a)
    want = first @ second
    keep = want > 0  # top-k leaves some tokens impossible; none may appear
    assert counts[~keep].sum() == 0
    df = int(keep.sum()) - 1
    assert chi_square(counts[keep], want[keep] / want[keep].sum()) < CHI2_999[df]


def test_errors_are_one_clear_line():
    model = tiny("gpt2-tiny")
    spec = Speculative(NgramDrafter())
    with pytest.raises(ValueError, match="batch 1"):
        generate(model, [[1], [2]], GenerationConfig(4, GREEDY), speculative=spec)
    with pytest.raises(ValueError, match="does not crop"):
        generate(model, [[1] * 60], GenerationConfig(10, GREEDY), speculative=spec)
    with pytest.raises(ValueError, match="share the tokenizer"):
        other = ModelDrafter(tiny("gpt2-tiny", vocab=50))
        generate(model, [[1]], GenerationConfig(4, GREEDY), speculative=Speculative(other))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Speculative(NgramDrafter(), num_draft_tokens=0)
