"""attnlab/lab/heads.py and the head mask of components/attention.py, against references:
hooks on o_proj's input, the model with a sublayer taken out, finite differences of the loss,
hand-built attention patterns, a truncated model for the logit lens, and a trained induction head.
"""

import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.cli.__main__ import main
from attnlab.components.attention import Attention
from attnlab.components.mla import MultiHeadLatentAttention
from attnlab.lab.heads import (
    first_token_score,
    head_importance,
    induction_chance,
    induction_score,
    induction_scores,
    lm_loss,
    logit_lens,
    mean_logit_lens,
    offset_score,
    pattern_scores,
    prunable_fraction,
    pruning_curve,
    repeated_tokens,
    set_head_mask,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset


class Zero(nn.Module):
    """A sublayer that contributes nothing: the reference for a sublayer taken out."""

    def forward(self, x, *args):
        return torch.zeros_like(x)


def tiny_lm(preset: str = "llama-tiny", **changes) -> nn.Module:
    torch.manual_seed(0)
    return build_model(replace(get_preset(preset), **changes)).eval()


def pre_o_proj(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tensor o_proj receives, (B, T, H * D), caught by a forward pre-hook."""
    seen = []
    hook = attn.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        attn(x)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_a_masked_head_is_exactly_zero_before_o_proj(n_kv_heads):
    attn = Attention(32, 4, n_kv_heads=n_kv_heads).eval()
    x = torch.randn(2, 5, 32)
    plain = pre_o_proj(attn, x).view(2, 5, 4, 8)  # (B, T, H, D)
    attn.head_mask = torch.tensor([1.0, 0.0, 1.0, 0.5])
    masked = pre_o_proj(attn, x).view(2, 5, 4, 8)
    assert plain[:, :, 1].abs().min() > 0
    assert torch.equal(masked[:, :, 1], torch.zeros(2, 5, 8))
    assert torch.equal(masked[:, :, [0, 2]], plain[:, :, [0, 2]])
    torch.testing.assert_close(masked[:, :, 3], 0.5 * plain[:, :, 3])


@pytest.mark.parametrize("absorb", [False, True])
def test_mla_heads_are_masked_too(absorb):
    attn = MultiHeadLatentAttention(32, 4, 8, 4, 8, 8, absorb=absorb).eval()
    x = torch.randn(2, 5, 32)
    plain = pre_o_proj(attn, x).view(2, 5, 4, -1)
    attn.head_mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    masked = pre_o_proj(attn, x).view(2, 5, 4, -1)
    assert torch.equal(masked[:, :, 0], torch.zeros_like(masked[:, :, 0]))
    assert torch.equal(masked[:, :, 1:], plain[:, :, 1:])


def test_a_float32_mask_keeps_a_bf16_layer_in_bf16():
    attn = Attention(32, 4).to(torch.bfloat16).eval()
    attn.head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert attn(torch.randn(2, 5, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_no_mask_and_all_ones_change_nothing():
    model = tiny_lm()
    ids = torch.randint(256, (2, 12))
    plain = model(ids)
    set_head_mask(model, torch.ones(2, 4))
    assert torch.equal(model(ids), plain)
    set_head_mask(model, None)
    assert all(b.self_attn.head_mask is None for b in model.blocks)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_masking_every_head_of_a_layer_removes_its_attention_sublayer(preset):
    """The block then computes x + 0 + FFN(...): the same as with the sublayer replaced by zero
    output (GPT-2's o_proj bias set to zero: a gate sits before o_proj, so the bias stays)."""
    model = tiny_lm(preset)
    if model.blocks[1].self_attn.o_proj.bias is not None:
        nn.init.zeros_(model.blocks[1].self_attn.o_proj.bias)
    reference = copy.deepcopy(model)
    reference.blocks[1].self_attn = Zero()
    ids = torch.randint(256, (2, 12))
    mask = torch.ones(2, 4)
    mask[1] = 0.0
    set_head_mask(model, mask)
    assert torch.equal(model(ids), reference(ids))
    set_head_mask(model, None)
    assert not torch.allclose(model(ids), reference(ids))


def test_a_mask_of_the_wrong_shape_is_one_clear_error():
    with pytest.raises(ValueError, match=r"head mask of shape \(4, 2\).*give shape \(2, 4\)"):
        set_head_mask(tiny_lm(), torch.ones(4, 2))
    with pytest.raises(ValueError, match="causal LM"):
        set_head_mask(tiny_lm("bert-tiny"), None)


def test_importance_equals_finite_differences_of_the_loss():
    """Michel et al.'s score |dL/dxi| against |L(xi=1) - L(xi=1-eps)| / eps, per head and batch,
    in float64 (a first-order difference: its error is O(eps)); normalised rows have unit norm."""
    model = tiny_lm().double()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(256, (2, 9), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]))
    raw, normalised = head_importance(model, batches)
    eps = 1e-3  # RMSNorm keeps its statistics in float32: a smaller step meets that rounding
    expected = torch.zeros(2, 4, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            base = lm_loss(model, batch)
            for layer in range(2):
                for head in range(4):
                    gate = torch.ones(2, 4, dtype=torch.float64)
                    gate[layer, head] = 1 - eps
                    set_head_mask(model, gate)
                    expected[layer, head] += ((base - lm_loss(model, batch)) / eps).abs()
            set_head_mask(model, None)
    expected /= len(batches)
    assert expected.min() > 1e-4  # every head matters a little: the comparison is not 0 == 0
    torch.testing.assert_close(raw.double(), expected, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(normalised.norm(dim=1), torch.ones(2, dtype=normalised.dtype))
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


def test_pruning_curve_runs_from_the_full_model_to_no_attention_at_all():
    model = tiny_lm()
    ids = torch.randint(256, (3, 13))
    batches = [(ids[:, :-1], ids[:, 1:])]
    curve = pruning_curve(model, batches, list(range(7, -1, -1)))
    assert len(curve) == 9
    assert all(b.self_attn.head_mask is None for b in model.blocks)  # left as it was found
    no_attention = copy.deepcopy(model)
    for block in no_attention.blocks:
        block.self_attn = Zero()
    with torch.no_grad():
        assert curve[0] == pytest.approx(lm_loss(model, batches[0]).item(), rel=1e-6)
        assert curve[-1] == pytest.approx(lm_loss(no_attention, batches[0]).item(), rel=1e-6)
        mask = torch.ones(8)
        mask[[7, 6, 5]] = 0.0  # the first three of the order: layer 1's heads 3, 2, 1
        set_head_mask(model, mask.view(2, 4))
        assert curve[3] == pytest.approx(lm_loss(model, batches[0]).item(), rel=1e-6)


def test_prunable_fraction_stops_at_the_first_loss_above_one_percent():
    assert prunable_fraction([2.0, 2.01, 2.015, 2.03, 1.0]) == 0.5  # 3 masked: 2.03 > 2.02
    assert prunable_fraction([2.0, 1.9, 1.95, 2.019, 2.0]) == 1.0
    assert prunable_fraction([2.0, 2.5, 2.0]) == 0.0


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


@pytest.mark.slow
def test_cli_lab_heads_end_to_end_in_fast_mode(tmp_path, capsys):
    text = "tests/data/tinyshakespeare_head.txt"
    run = tmp_path / "run"
    train = ["train", "--preset", "llama-tiny", "--data.source", text, "--data.cache_dir"]
    train += [str(tmp_path / "cache"), "--train.steps", "2", "--train.batch_size", "2"]
    train += ["--train.context", "32", "--train.progress", "false", "--train.out_dir", str(run)]
    train += ["--train.device", "cpu", "--train.sample_tokens", "0", "--train.eval_batches", "1"]
    assert main(train) == 0
    capsys.readouterr()
    out = tmp_path / "lab"
    assert main(["lab", "heads", "--ckpt", str(run), "--fast", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prunable at <= 1% loss increase" in printed and "logit lens" in printed
    result = json.loads((out / "heads.json").read_text())
    assert (result["layers"], result["heads"]) == (2, 4)
    expected = {"importance", "previous_token", "same_position", "first_token", "offset_2"}
    assert set(result["scores"]) == expected | {"induction"}
    assert len(result["pruning"]["by_importance"]) == 9
    assert len(result["pruning"]["random"]) == 2
    assert len(result["pruning"]["by_raw_importance"]) == 9
    assert result["options"]["context"] == 32 and result["options"]["repeat_len"] == 16
    assert sorted(result["pruning"]["importance_order"]) == list(range(8))
    assert [r["stream"] for r in result["logit_lens"]][-1] == "block 1"
    for name in ("heads.png", "pruning.png", "attention.html", "attention_decoder_self.png"):
        assert (out / name).stat().st_size > 1000
    assert main(["lab", "heads", "--ckpt", str(tmp_path / "nothing"), "--fast"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
