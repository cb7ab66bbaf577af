"""attnlab/lab/heads.py and its head mask (a hook on an attention layer's hook_z), against
references: hooks on o_proj's input, the model with a sublayer taken out, finite differences of
the loss; and `attnlab lab heads` end to end.
"""

import copy
import json

import pytest
import torch
from torch import nn

from attnlab.cli.__main__ import main
from attnlab.components.attention import Attention
from attnlab.components.mla import MultiHeadLatentAttention
from attnlab.lab.head_masks import HeadGate, head_gates, set_head_mask
from attnlab.lab.heads import (
    HeadsLab,
    head_importance,
    lm_loss,
    prunable_fraction,
    pruning_curve,
    pruning_levels,
)
from tests.lab.helpers import Zero, tiny_lm


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
    attn.hook_z.add(HeadGate(torch.tensor([1.0, 0.0, 1.0, 0.5])))
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
    attn.hook_z.add(HeadGate(torch.tensor([0.0, 1.0, 1.0, 1.0])))
    masked = pre_o_proj(attn, x).view(2, 5, 4, -1)
    assert torch.equal(masked[:, :, 0], torch.zeros_like(masked[:, :, 0]))
    assert torch.equal(masked[:, :, 1:], plain[:, :, 1:])


def test_a_float32_mask_keeps_a_bf16_layer_in_bf16():
    attn = Attention(32, 4).to(torch.bfloat16).eval()
    attn.hook_z.add(HeadGate(torch.tensor([1.0, 0.0, 1.0, 1.0])))
    assert attn(torch.randn(2, 5, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_no_mask_and_all_ones_change_nothing():
    model = tiny_lm()
    ids = torch.randint(256, (2, 12))
    plain = model(ids)
    set_head_mask(model, torch.ones(2, 4))
    assert torch.equal(model(ids), plain)
    set_head_mask(model, None)
    assert all(not head_gates(b.self_attn) for b in model.blocks)


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
    assert all(not head_gates(b.self_attn) for b in model.blocks)  # left as it was found
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
    assert prunable_fraction([2.0, 2.01, 2.5], [0.0, 0.3, 0.6]) == 0.3  # a coarse grid


def test_a_coarse_curve_is_the_full_curve_at_seventeen_levels():
    assert pruning_levels(270, "coarse") == [round(i * 270 / 16) for i in range(17)]
    assert pruning_levels(8, "coarse") == list(range(9))  # fewer heads than levels: all
    assert pruning_levels(8) == list(range(9))
    with pytest.raises(ValueError, match="'some': choose full or coarse"):
        pruning_levels(8, "some")
    model = tiny_lm()
    ids = torch.randint(256, (3, 13))
    batches = [(ids[:, :-1], ids[:, 1:])]
    order = [3, 6, 0, 7, 1, 5, 2, 4]
    full = pruning_curve(model, batches, order)
    coarse = pruning_curve(model, batches, order, [0, 2, 5, 8])
    assert coarse == pytest.approx([full[k] for k in (0, 2, 5, 8)], rel=1e-6)


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
    heads = ["lab", "heads", "--ckpt", str(run), "--fast", "--out", str(out)]
    assert main([*heads, "--check-induction", "2"]) == 0
    printed = capsys.readouterr().out
    assert "prunable at <= 1% loss increase" in printed and "logit lens" in printed
    assert "induction check, the top 2 heads by score" in printed
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
    assert len(result["induction_check"]["patching"]["per_head"]) == 2
    pictures = ("heads.png", "pruning.png", "induction.png", "attention.html")
    for name in (*pictures, "attention_decoder_self.png"):
        assert (out / name).stat().st_size > 1000
    assert main([*heads, "--context", "16"]) == 2
    assert "--fast sets the sizes itself; leave out --context" in capsys.readouterr().err
    assert main(["lab", "heads", "--ckpt", str(tmp_path / "nothing"), "--fast"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_sizes_below_their_least_are_one_clear_error():
    with pytest.raises(ValueError, match="--batches 0: give at least 1"):
        HeadsLab(ckpt="run", batches=0)
    with pytest.raises(ValueError, match="--repeat-len 1: give at least 2"):
        HeadsLab(ckpt="run", repeat_len=1)
    with pytest.raises(ValueError, match="--curves 'half': choose one of full, coarse, none"):
        HeadsLab(ckpt="run", curves="half")
