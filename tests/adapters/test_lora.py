"""LoRA against the paper's formula and against itself merged; QLoRA on int8 and int4 bases.

(Parity with `peft` on HF models is in test_lora_peft.py.)
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.adapters.lora import (
    LoRALinear,
    add_lora,
    count_parameters,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    unmerge_lora,
)
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import Int4Linear, Int8Linear, quantize_model


def tiny(preset: str = "gpt2-tiny") -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_preset(preset)).eval()


def randomize_B(model: nn.Module, std: float = 0.1) -> None:
    """A non-zero B, so the adapters change the outputs (B starts at zero)."""
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0.0, std)


def ids(B: int = 2, T: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))


def test_forward_is_the_papers_formula():
    base = nn.Linear(12, 10)
    lora = LoRALinear(base, rank=4, alpha=8.0)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 5, 12)
    W = base.weight + (8.0 / 4) * lora.lora_B @ lora.lora_A  # W0 + (alpha/r) B A
    torch.testing.assert_close(lora(x), F.linear(x, W, base.bias), atol=1e-5, rtol=0)


def test_init_a_kaiming_uniform_b_zero_and_base_frozen():
    torch.manual_seed(3)
    lora = LoRALinear(nn.Linear(64, 32), rank=8, alpha=16)
    assert torch.equal(lora.lora_B, torch.zeros(32, 8))
    # kaiming_uniform(a=sqrt(5)) on fan_in K: bound = sqrt(6 / ((1 + a^2) K)) = 1 / sqrt(K)
    bound = 1 / math.sqrt(64)
    assert lora.lora_A.abs().max() <= bound and lora.lora_A.abs().max() > 0.9 * bound
    assert not any(p.requires_grad for p in lora.base.parameters())
    x = torch.randn(4, 64)
    torch.testing.assert_close(lora(x), lora.base(x), atol=0, rtol=0)  # starts as the base


def test_a_bf16_base_keeps_fp32_adapters_and_its_own_output_dtype():
    base = nn.Linear(32, 16).to(torch.bfloat16)
    lora = LoRALinear(base, rank=4, alpha=8)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    y = lora(x)
    assert y.dtype == torch.bfloat16 and lora.lora_A.dtype == lora.lora_B.dtype == torch.float32
    want = base(x).float() + (x.float() @ lora.lora_A.T @ lora.lora_B.T) * lora.scale
    torch.testing.assert_close(y.float(), want, atol=0.05, rtol=0.01)  # bf16 rounding of y
    y.float().sum().backward()
    assert lora.lora_B.grad.dtype == torch.float32 and lora.lora_B.grad.abs().max() > 0


def test_dropout_applies_to_the_input_of_A_only():
    lora = LoRALinear(nn.Linear(16, 12), rank=2, alpha=2, dropout=0.5).train()
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    out = lora(x)
    torch.manual_seed(5)
    dropped = F.dropout(x, 0.5, training=True)  # the same mask (the same RNG draws)
    want = lora.base(x) + (dropped @ lora.lora_A.T @ lora.lora_B.T) * lora.scale
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        lora.eval()
        assert torch.equal(lora(x), lora(x))  # no dropout at evaluation


def test_add_lora_wraps_targets_freezes_the_rest():
    model = tiny()
    names = add_lora(model, ("q", "v"), rank=4, alpha=8)
    assert names == [f"blocks.{i}.self_attn.{p}" for p in ("q_proj", "v_proj") for i in (0, 1)]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in names for x in "AB"}
    assert set(lora_state_dict(model)) == trainable
    assert add_lora(tiny(), "mlp") == [
        f"blocks.{i}.ffn.{p}" for p in ("up_proj", "down_proj") for i in (0, 1)
    ]
    assert add_lora(tiny(), "blocks.1.self_attn.o_proj") == ["blocks.1.self_attn.o_proj"]


def test_bad_targets_fail_with_one_clear_line():
    with pytest.raises(ValueError, match=r"LoRA target 'qkv' matches no Linear layer .*q_proj"):
        add_lora(tiny(), "qkv")
    model = tiny()
    add_lora(model, "q")
    with pytest.raises(ValueError, match="already have LoRA"):
        add_lora(model, "q_proj")
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoRALinear(nn.Linear(4, 4), rank=0, alpha=1)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_merge_equals_unmerged_and_unmerge_restores_the_base(preset):
    model = tiny(preset)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, ("q", "k", "v", "o", "mlp"), rank=4, alpha=8)
    randomize_B(model)
    x = ids(vocab=get_preset(preset).vocab_size)
    with torch.no_grad():
        unmerged = model(x)
        merge_lora(model)
        merged = model(x)
        assert all(m.merged for m in lora_modules(model).values())
        unmerge_lora(model)
        again = model(x)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, unmerged, atol=1e-5, rtol=0)
    remove_lora(model)
    after = model.state_dict()
    assert after.keys() == base.keys()
    assert max((after[k] - base[k]).abs().max().item() for k in base) <= 1e-6


def test_remove_lora_with_merge_keeps_the_outputs():
    model = tiny("llama-tiny")
    add_lora(model, ("q", "v"), rank=4, alpha=8)
    randomize_B(model)
    x = ids()
    with torch.no_grad():
        before = model(x)
        remove_lora(model, merge=True)
        after = model(x)
    assert not lora_modules(model)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qlora_steps_lower_the_loss_and_train_only_the_adapters(scheme):
    model = quantize_model(tiny(), scheme, group_size=32)
    kind = Int8Linear if scheme == "int8" else Int4Linear
    add_lora(model, ("q", "v", "mlp"), rank=8, alpha=16)
    assert all(isinstance(m.base, kind) for m in lora_modules(model).values())
    frozen = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    adapters = lora_state_dict(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = ids(B=4, T=32)
    model.train()
    losses = []
    for _ in range(8):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # base bytes identical
    assert all(not torch.equal(after[k], v) for k, v in adapters.items())  # every adapter moved
    assert all(m.lora_A.dtype == torch.float32 for m in lora_modules(model).values())


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_gradient_flows_through_a_quantized_linear_to_its_input(kind):
    """QLoRA needs d(out)/d(x) through the frozen quantized layers above each adapter: equal to
    the gradient through the dequantized weight (the fused kernels have no backward)."""
    q = kind.from_linear(nn.Linear(64, 48))
    x = torch.randn(5, 64, requires_grad=True)
    (q(x) ** 2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (q.reference_forward(x2) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=0)


def test_merge_refuses_a_quantized_base():
    model = quantize_model(tiny(), "int8")
    add_lora(model, "q")
    with pytest.raises(ValueError, match="cannot merge LoRA into a quantized Int8Linear"):
        merge_lora(model)


def test_trainable_count_of_gpt2_small_with_rank_8_on_q_v():
    with torch.device("meta"):
        model = build_model(get_preset("gpt2"))
    _, base_total = count_parameters(model)
    assert base_total == 124_439_808  # HF's GPT2LMHeadModel (tied head counted once)
    add_lora(model, ("q", "v"), rank=8, alpha=16)
    trainable, total = count_parameters(model)
    L, r, C = 12, 8, 768
    # per wrapped (C -> C) Linear: A (r, C) + B (C, r) = r (C + C); two of them per layer
    assert trainable == 2 * L * r * (C + C) == 294_912
    assert total == base_total + trainable
    assert trainable / total <= 0.003
    print(
        f"\ngpt2 (124M) LoRA r=8 on q,v: {trainable:,} trainable of {total:,} "
        f"({trainable / total:.4%})"
    )


def adamw_state_bytes(model: nn.Module) -> int:
    """Bytes of AdamW's state (exp_avg, exp_avg_sq, step) once it has taken a step; on a meta
    model the moments take no memory, but their sizes are the real ones."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )


def test_adamw_state_bytes_lora_vs_full_on_gpt2_small():
    with torch.device("meta"):
        full_model = build_model(get_preset("gpt2"))
        lora_model = build_model(get_preset("gpt2"))
    add_lora(lora_model, ("q", "v"), rank=8, alpha=16)
    full, lora = adamw_state_bytes(full_model), adamw_state_bytes(lora_model)
    # two fp32 moments per trainable parameter, plus a 4-byte step counter per tensor
    assert full == 8 * 124_439_808 + 4 * len(list(full_model.parameters()))
    assert lora == 8 * 294_912 + 4 * len(lora_state_dict(lora_model))
    print(
        f"\ngpt2 (124M) AdamW state: full fine-tuning {full:,} B ({full / 2**20:.1f} MiB), "
        f"LoRA r=8 on q,v {lora:,} B ({lora / 2**20:.2f} MiB), {lora / full:.3%} of it"
    )


def trained_extras(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]


def test_bias_and_modules_to_save_train_what_peft_names():
    """bias "all": every parameter named "bias" or ending in ".bias" (LayerNorms' too);
    "lora_only": the adapted Linears' biases; modules_to_save: every module whose name ends
    with the string (peft's plain `endswith`: "norm" matches "embed_norm"), all of it."""
    biases = sorted(n for n, _ in tiny("bert-tiny").named_parameters() if n.endswith(".bias"))
    model = tiny("bert-tiny")
    add_lora(model, ("q", "v"), rank=2, bias="all")
    assert sorted(n.replace(".base.", ".") for n in trained_extras(model)) == biases
    model = tiny("bert-tiny")
    add_lora(model, ("q", "v"), rank=2, bias="lora_only")
    assert trained_extras(model) and all(
        n.endswith(("q_proj.base.bias", "v_proj.base.bias")) for n in trained_extras(model)
    )
    model = tiny("bert-tiny")
    add_lora(model, ("q", "v"), rank=2, modules_to_save=["norm"])
    extras = trained_extras(model)
    assert "encoder.embed_norm.weight" in extras and "encoder.embed_norm.bias" in extras
    norms = {n for n, m in model.named_modules() if type(m).__name__ == "LayerNorm"}
    assert {n.rpartition(".")[0] for n in extras} == norms
    trainable, _ = count_parameters(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if n in extras) + sum(
        m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model).values()
    )


def test_bad_bias_and_modules_to_save_are_named():
    with pytest.raises(
        ValueError, match=r"LoRA bias must be one of \['none', 'all', 'lora_only'\]"
    ):
        add_lora(tiny("bert-tiny"), ("q",), bias="some")
    with pytest.raises(ValueError, match="modules_to_save 'nothing' matches no module"):
        add_lora(tiny("bert-tiny"), ("q",), modules_to_save="nothing")
    with pytest.raises(ValueError, match="modules_to_save 'q_proj' matches .* carry LoRA adapters"):
        add_lora(tiny("bert-tiny"), ("q",), modules_to_save="q_proj")
