"""attnlab/lab/head_scores.py against references: hand-built attention patterns with their
scores worked out by hand, a model cut after each block for the logit lens, and induction heads
that training on repeated sequences makes (Olsson et al. 2022).
"""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.lab.head_scores import (
    first_token_score,
    induction_chance,
    induction_score,
    induction_scores,
    logit_lens,
    mean_logit_lens,
    offset_score,
    pattern_scores,
    repeated_tokens,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.lab.helpers import Zero, tiny_lm


def hand_patterns(T: int) -> torch.Tensor:
    """(1, 2, T, T): head 0 attends to the previous token (query 0 to itself), head 1 uniformly
    to every earlier key and itself."""
    prev = torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    return torch.stack([prev, uniform])[None]


def test_previous_token_and_positional_scores_of_hand_built_patterns():
    T = 6
    probs = hand_patterns(T)
    by_hand_uniform = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)  # A[i, i-1] = 1/(i+1)
    torch.testing.assert_close(offset_score(probs, 1), torch.tensor([1.0, by_hand_uniform]))
    torch.testing.assert_close(
        offset_score(probs, 0), torch.tensor([1 / T, sum(1 / (i + 1) for i in range(T)) / T])
    )
    torch.testing.assert_close(
        first_token_score(probs), torch.tensor([1 / (T - 1), by_hand_uniform])
    )
    two_back = sum(1 / (i + 1) for i in range(2, T)) / (T - 2)
    torch.testing.assert_close(offset_score(probs, 2), torch.tensor([0.0, two_back]))
    scores = pattern_scores([probs, probs.flip(1)], offsets=(2,))
    assert set(scores) == {"previous_token", "same_position", "first_token", "offset_2"}
    torch.testing.assert_close(scores["previous_token"][1], torch.tensor([by_hand_uniform, 1.0]))


def test_induction_score_of_a_hand_built_induction_head_and_of_uniform_attention():
    n = 5
    induction = torch.zeros(2 * n, 2 * n)
    induction[:n, 0] = 1.0  # the first copy has nothing to look back at
    induction[n + torch.arange(n), torch.arange(n) + 1] = 1.0  # token after the first occurrence
    probs = torch.stack([induction, hand_patterns(2 * n)[0, 1]])[None]  # (1, 2, 2n, 2n)
    score = induction_score(probs)
    assert score[0] == 1.0
    assert score[1] == pytest.approx(induction_chance(n))
    assert induction_chance(n) == pytest.approx(sum(1 / (n + j + 1) for j in range(n)) / n)


def test_repeated_tokens_are_two_copies_of_distinct_tokens():
    ids = repeated_tokens(10, 7, 3, seed=0)
    assert ids.shape == (3, 14) and torch.equal(ids[:, :7], ids[:, 7:])
    assert all(len(set(row[:7].tolist())) == 7 for row in ids)
    assert torch.equal(ids, repeated_tokens(10, 7, 3, seed=0))
    with pytest.raises(ValueError, match="n=11"):
        repeated_tokens(10, 11, 1, seed=0)


def test_logit_lens_equals_a_model_cut_after_each_block():
    model = tiny_lm(n_layers=3)
    ids = torch.randint(256, (2, 11))
    x, y = ids[:, :-1], ids[:, 1:]
    rows = logit_lens(model, x, y)
    assert [r["stream"] for r in rows] == ["embedding", "block 0", "block 1", "block 2"]
    final = model(x)
    for depth in range(4):  # the reference: the same model with only its first `depth` blocks
        cut = copy.deepcopy(model)
        cut.blocks = nn.ModuleList(list(cut.blocks)[:depth])
        with torch.no_grad():
            logits = cut(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
        agreement = (logits.argmax(-1) == final.argmax(-1)).float().mean().item()
        assert rows[depth]["loss"] == pytest.approx(loss, rel=1e-5)
        assert rows[depth]["agreement"] == pytest.approx(agreement)
    assert rows[-1]["agreement"] == 1.0
    x2, y2 = torch.randint(256, (2, 2, 10)).unbind(1)
    second = logit_lens(model, x2, y2)
    averaged = mean_logit_lens(model, [(x, y), (x2, y2)])
    for row, a, b in zip(averaged, rows, second):
        assert row["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2)
        assert row["agreement"] == pytest.approx((a["agreement"] + b["agreement"]) / 2)


@pytest.mark.slow
def test_induction_heads_appear_in_a_trained_two_layer_attention_only_model():
    """Olsson et al. 2022: trained on [r, r] with the repeat length varied (so no fixed offset
    solves it), a layer-2 head attends from the second copy to the token after the first
    occurrence; the same model untrained attends at chance. The trained score settles near 0.8,
    not 1: the loss reaches its floor (only the second copy's first token is unpredictable)
    while the heads keep some mass on the first token and on the previous occurrence itself."""
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), vocab_size=64, max_seq_len=64)
    cfg = replace(cfg, attention=replace(cfg.attention, n_heads=2, n_kv_heads=2))
    model = build_model(cfg)
    for block in model.blocks:
        block.ffn = Zero()  # attention only
    V, n = 64, 16
    untrained = induction_scores(model.eval(), V, n, batch=32, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(1000):
        k = 6 + step % 19  # repeat lengths 6..24
        ids = repeated_tokens(V, k, 32, seed=1000 + step)  # (32, 2k)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, k - 1 :].flatten(0, 1), ids[:, k:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = induction_scores(model.eval(), V, n, batch=32, seed=1)
    chance = induction_chance(n)
    assert untrained.max() < 1.5 * chance
    assert trained[1].max() > 0.7 > 10 * chance
    assert trained[0].max() < 0.2  # layer 1 is not where it happens
