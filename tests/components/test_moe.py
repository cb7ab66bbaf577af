"""components/moe.py: routing properties (k distinct experts, gates summing to one), one expert
at top-1 is the dense FFN, the grouped forward against a per-token reference, and the router and
the load-balancing loss against transformers' own (Mixtral's loss, DeepSeek-V3's router)."""

import itertools

import pytest
import torch

from attnlab.components.ffn import GatedMLP
from attnlab.components.hooks import run_with_cache
from attnlab.components.moe import (
    MoE,
    grouped_experts,
    load_balancing_loss,
    route,
    take_expert_load,
    update_router_bias,
)
from attnlab.models.config import MoEConfig

ROUTINGS = list(  # every combination: E, k, score, normalize, group-limited
    itertools.product([2, 4, 8], [1, 2, 3, 4], ["softmax", "sigmoid"], [False, True], [False, True])
)


def test_every_token_reaches_k_distinct_experts():
    """The acceptance property, over every routing combination (seeded logits and biases)."""
    for seed, (n_experts, k, score, normalize, grouped) in enumerate(ROUTINGS):
        k = min(k, n_experts)
        groups, topk_groups = (2, 1) if grouped and k <= n_experts // 2 else (1, 1)
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(7, n_experts, generator=g)
        bias = torch.randn(n_experts, generator=g) if score == "sigmoid" else None
        gates, experts = route(logits, k, score, normalize, bias, groups, topk_groups)
        assert experts.shape == gates.shape == (7, k)
        assert all(len(set(row)) == k for row in experts.tolist())  # k different experts each
        assert bool((gates >= 0).all())
        if normalize:
            torch.testing.assert_close(gates.sum(-1), torch.ones(7))
        if groups > 1:  # every choice inside one group of E/2 experts
            assert all(len({e // (n_experts // 2) for e in row}) == 1 for row in experts.tolist())


def test_softmax_then_renormalise_is_softmax_over_the_top_k():
    """Mixtral's paper takes the top-k logits and softmaxes over them; HF softmaxes over all
    experts, takes the top k and renormalises: the same gates."""
    logits = torch.randn(10, 8)
    gates, experts = route(logits, 2, "softmax", normalize=True)
    top = logits.topk(2, dim=-1)
    torch.testing.assert_close(gates, top.values.softmax(-1))
    assert torch.equal(experts, top.indices)


def test_one_expert_at_top_1_is_the_dense_ffn():
    torch.manual_seed(0)
    layer = MoE(16, 24, n_experts=1, k=1).eval()
    dense = GatedMLP(16, 24)
    dense.load_state_dict(layer.experts[0].state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), dense(x), atol=1e-6, rtol=0)


def test_grouped_forward_equals_a_per_token_loop():
    torch.manual_seed(0)
    ffns = torch.nn.ModuleList(GatedMLP(8, 12) for _ in range(4))
    x = torch.randn(9, 8)
    gates, experts = route(torch.randn(9, 4), 3, "softmax", normalize=False)
    expected = torch.stack(
        [sum(gates[t, i] * ffns[experts[t, i]](x[t]) for i in range(3)) for t in range(9)]
    )
    torch.testing.assert_close(grouped_experts(x, gates, experts, ffns), expected)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 6, 8, generator=g) for _ in range(3))  # 3 layers, B=2, T=6
    mask = torch.arange(6)[None] < torch.tensor([[6], [4]]) if masked else None
    expected = mixtral.load_balancing_loss_func(logits, 8, 2, None if mask is None else mask.long())
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask), expected)


def test_balanced_routing_gives_the_loss_its_minimum_k():
    logits = torch.zeros(16, 4)  # every expert equally likely; ties broken one way
    assert load_balancing_loss([logits], 2).item() == pytest.approx(2.0, abs=1e-6)


def test_sigmoid_grouped_router_equals_deepseek_v3():
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = pytest.importorskip("transformers").DeepseekV3Config(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2
    )
    torch.manual_seed(0)
    router = ds.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(11, 16)
    logits, hf_gates, hf_experts = router(x)
    scale = config.routed_scaling_factor
    gates, experts = route(logits, 3, "sigmoid", True, router.e_score_correction_bias, 4, 2, scale)
    order, hf_order = experts.sort(-1), hf_experts.sort(-1)  # HF's top-k is unsorted
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(gates.gather(1, order.indices), hf_gates.gather(1, hf_order.indices))


def test_expert_load_and_the_loss_free_bias_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(8, 8, 4, 2, score="sigmoid", bias_update_rate=0.1))
    layer = model[0]
    model(torch.randn(1, 10, 8))
    load = take_expert_load(model)
    assert load.shape == (1, 4) and load.sum().item() == 20  # 10 tokens x k = 2
    assert layer.expert_load is None  # cleared
    update_router_bias(model, load)
    expected = 0.1 * torch.sign(load[0].float().mean() - load[0].float())
    torch.testing.assert_close(layer.router_bias, expected)  # busy experts go down


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_experts": 4, "n_experts_per_token": 5}, "n_experts_per_token=5"),
        ({"score": "hash"}, "moe.score='hash'"),
        ({"n_experts": 6, "n_groups": 4}, "n_groups=4"),
        ({"bias_update_rate": 0.01}, "bias_update_rate"),
    ],
)
def test_bad_moe_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        MoEConfig(**kwargs)


def test_hooks_read_the_gates_and_the_output():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(8, 8, 4, 2))
    out, cache = run_with_cache(model, torch.randn(1, 3, 8), names=["0.hook_gates", "0.hook_out"])
    assert cache["0.hook_gates"].shape == (3, 2) and torch.equal(cache["0.hook_out"], out)
