"""AdamW parameter groups: decay on Linear matrices only, each parameter exactly once."""

import pytest
import torch
from torch import nn

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.optim import build_optimizer, param_groups


def groups_by_id(model):
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    return {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}, decay, no_decay


@pytest.mark.parametrize(
    "preset", ["llama-tiny", "gpt2-tiny", "bert-tiny", "transformer-tiny", "t5-tiny"]
)
def test_linear_weights_decay_everything_else_does_not(preset):
    model = build_model(get_preset(preset))
    decay, no_decay, *groups = groups_by_id(model)
    # Each parameter exactly once, none missing.
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed)) == len(list(model.parameters()))
    assert set(listed) == {id(p) for p in model.parameters()}

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            where = f"{name}.{pname}"
            if isinstance(module, nn.Embedding) or id(p) in embeddings:
                assert id(p) in no_decay, where  # token/position tables, tied heads, T5 buckets
            elif isinstance(module, nn.Linear) and pname == "weight":
                assert id(p) in decay, where
            else:
                assert id(p) in no_decay, where  # norm gains and biases
                assert p.ndim == 1 or "relative_attention_bias" in where, where
    # Every decayed tensor is a matrix; names from the glossary land where expected.
    assert all(p.ndim == 2 for g in groups[:1] for p in g["params"])
    params = dict(model.named_parameters())
    assert any(n.endswith("q_proj.weight") and id(p) in decay for n, p in params.items())
    assert all(id(p) in no_decay for n, p in params.items() if "norm" in n)


def test_tied_head_is_not_decayed_even_when_the_head_comes_first():
    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 20, bias=False)
            self.proj = nn.Linear(8, 8)
            self.embed = nn.Embedding(20, 8)
            self.head.weight = self.embed.weight  # tied, and seen first through the head

    model = HeadFirst()
    decay, no_decay, *_ = groups_by_id(model)
    assert decay == {id(model.proj.weight)}
    assert no_decay == {id(model.embed.weight), id(model.proj.bias)}


def test_frozen_parameters_are_left_out():
    model = build_model(get_preset("llama-tiny"))
    model.embed.weight.requires_grad_(False)
    _, _, *groups = groups_by_id(model)
    assert all(p is not model.embed.weight for g in groups for p in g["params"])


def test_build_optimizer_uses_the_groups():
    model = build_model(get_preset("gpt2-tiny"))
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    opt = build_optimizer(model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    assert type(opt) is torch.optim.AdamW  # plain by default: FlatAdamW is an opt-in accelerator
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage  # nothing moved
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
