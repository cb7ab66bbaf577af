"""FlatAdamW against torch.optim.AdamW over the separate parameters: same updates, same state."""

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from attnlab.accel.flat_adamw import FlatAdamW
from attnlab.checkpoint import read_checkpoint, save_checkpoint
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.optim import param_groups

CFG = replace(
    get_preset("gpt2-tiny"), d_model=32, n_layers=2, d_ff=64, max_seq_len=16, vocab_size=20
)
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.99), fused=True)


def _pair():
    torch.manual_seed(0)
    model = build_model(CFG)  # tied embedding and head
    twin = copy.deepcopy(model)
    return (
        (model, torch.optim.AdamW(param_groups(model, 0.1), **OPTIONS)),
        (twin, FlatAdamW(param_groups(twin, 0.1), **OPTIONS)),
    )


def _steps(model, opt, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (3, 16), generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_same(a: nn.Module, b: nn.Module):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_same_updates_and_state_as_adamw_over_the_separate_parameters():
    (ref, ref_opt), (model, opt) = _pair()
    params_before = list(model.parameters())
    _steps(ref, ref_opt, 5)
    _steps(model, opt, 5)
    _assert_same(ref, model)  # AdamW is elementwise: bit for bit
    assert list(model.parameters()) == params_before  # the same Parameter objects...
    assert model.head.weight is model.embed.weight  # ...tied ones still tied
    a, b = ref_opt.state_dict(), opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


def test_loads_a_plain_adamw_state_and_continues_the_same():
    (ref, ref_opt), (model, opt) = _pair()
    _steps(ref, ref_opt, 3)
    model.load_state_dict(ref.state_dict())  # in place: the parameters stay in the buffers
    opt.load_state_dict(ref_opt.state_dict())
    _steps(ref, ref_opt, 3, seed=1)
    _steps(model, opt, 3, seed=1)
    _assert_same(ref, model)


def test_gradients_land_in_the_flat_buffers_and_clip_the_same():
    (ref, _), (model, opt) = _pair()
    x = torch.randint(0, CFG.vocab_size, (3, 16))
    for m in (ref, model):
        m(x).square().mean().backward()
    flat_grads = torch.cat([g["params"][0].grad for g in opt.param_groups])
    assert flat_grads.abs().sum() > 0
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = nn.utils.clip_grad_norm_([g["params"][0] for g in opt.param_groups], 0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_zero_grad_zeroes_and_reattaches_views():
    _, (model, opt) = _pair()
    model(torch.randint(0, CFG.vocab_size, (2, 16))).sum().backward()
    view = model.embed.weight.grad
    model.embed.weight.grad = None  # e.g. someone's own zero_grad(set_to_none=True)
    opt.zero_grad()
    assert model.embed.weight.grad is view
    assert all(g["params"][0].grad.abs().sum() == 0 for g in opt.param_groups)


def test_a_gradient_put_outside_the_buffers_still_counts():
    (ref, ref_opt), (model, opt) = _pair()
    model.zero_grad(set_to_none=True)  # detaches every view: backward makes new tensors
    _steps(ref, ref_opt, 2)
    _steps(model, opt, 2)
    _assert_same(ref, model)


def test_a_checkpoint_of_a_flat_model_reads_back(tmp_path):
    _, (model, opt) = _pair()
    _steps(model, opt, 1)
    run = RunConfig(CFG, TrainConfig(), DataConfig(source="x.txt"))
    path = save_checkpoint(tmp_path / "ckpt", model, opt, run, {"step": 1})
    files = read_checkpoint(path)
    assert "head.weight" not in files["weights"]  # the tied matrix stored once
    for name, p in model.named_parameters():
        if name in files["weights"]:
            assert torch.equal(files["weights"][name], p), name


def test_mixed_dtypes_in_a_group_are_refused():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="float64"):
        FlatAdamW([{"params": params}], lr=1e-3)
