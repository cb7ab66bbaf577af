"""FastLinear against nn.Linear (the reference): outputs and every gradient, and the module swap."""

import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import attnlab.accel.fast_linear as fl
from attnlab.accel.fast_linear import (
    FastLinear,
    OneDNNLinearFunction,
    choose_fast_linear,
    disable_fast_linear,
    enable_fast_linear,
    fast_linear,
    measure_speedup,
    onednn_available,
)
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.objectives import clm_loss
from attnlab.training.optim import build_optimizer

pytestmark = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")
RTOL = 1e-5  # fp32: max |difference| relative to max |reference|; only summation order differs
IN, OUT = 24, 40
PROPERTY_RTOL = 1e-4  # hypothesis's shapes (below); the fixed shapes keep RTOL


def _rel_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, floor: float = 1e-12
) -> None:
    """max |actual - expected| <= rtol * max(max |expected|, floor)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().clamp(min=floor)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= rtol, f"max relative difference {err:.2e} > {rtol:.0e}"


def _pair(bias: bool) -> tuple[nn.Linear, nn.Linear]:
    """(reference nn.Linear, FastLinear) with the same weights."""
    ref = nn.Linear(IN, OUT, bias=bias)
    fast = FastLinear(IN, OUT, bias=bias)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _check_against_reference(ref: nn.Module, fast: nn.Module, x: torch.Tensor) -> None:
    """Forward outputs and the gradients of x and of every parameter agree."""
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_fast = ref(x_ref), fast(x_fast)
    _rel_close(y_fast, y_ref)
    grad_y = torch.randn_like(y_ref)
    y_ref.backward(grad_y)
    y_fast.backward(grad_y)
    _rel_close(x_fast.grad, x_ref.grad)
    for (name, p_ref), (_, p_fast) in zip(ref.named_parameters(), fast.named_parameters()):
        assert p_fast.grad is not None, name
        _rel_close(p_fast.grad, p_ref.grad)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, IN), (3, 5, IN)], ids=["2d", "3d"])
def test_forward_and_gradients_match_nn_linear(shape, bias):
    ref, fast = _pair(bias)
    _check_against_reference(ref, fast, torch.randn(*shape))


def test_one_row_and_1d_input():
    ref, fast = _pair(True)
    _check_against_reference(ref, fast, torch.randn(1, IN))
    _check_against_reference(ref, fast, torch.randn(IN))  # (in,) -> (out,), as F.linear


def test_non_contiguous_input():
    ref, fast = _pair(True)
    x = torch.randn(IN, 6, 4).permute(2, 1, 0)  # (4, 6, IN), not contiguous
    assert not x.is_contiguous()
    _check_against_reference(ref, fast, x)


def test_input_without_grad_gives_only_weight_gradients():
    ref, fast = _pair(True)
    x = torch.randn(9, IN)  # like the first layer's input: no grad wanted
    ref(x).sum().backward()
    fast(x).sum().backward()
    _rel_close(fast.weight.grad, ref.weight.grad)
    _rel_close(fast.bias.grad, ref.bias.grad)


def test_frozen_weight_gets_no_gradient():
    ref, fast = _pair(True)
    for m in (ref, fast):
        m.weight.requires_grad_(False)
    x = torch.randn(5, IN, requires_grad=True)
    fast(x).sum().backward()
    assert fast.weight.grad is None
    ref_x = x.detach().clone().requires_grad_()
    ref(ref_x).sum().backward()
    _rel_close(x.grad, ref_x.grad)
    _rel_close(fast.bias.grad, ref.bias.grad)


def test_double_precision_and_autocast_fall_back_to_f_linear():
    ref, fast = _pair(True)
    x = torch.randn(5, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y_fast = ref(x), fast(x)
    assert y_fast.dtype == torch.bfloat16
    torch.testing.assert_close(y_fast, y_ref, rtol=0, atol=0)  # the same F.linear call
    ref64, fast64 = ref.double(), fast.double()
    torch.testing.assert_close(fast64(x.double()), ref64(x.double()), rtol=0, atol=0)


def test_no_grad_forward():
    ref, fast = _pair(False)
    x = torch.randn(2, 3, IN)
    with torch.no_grad():
        _rel_close(fast(x), ref(x))


def test_empty_input():
    ref, fast = _pair(True)
    x = torch.randn(0, IN, requires_grad=True)
    assert fast(x).shape == ref(x).shape == (0, OUT)


def test_function_applied_directly_matches_f_linear():
    """OneDNNLinearFunction.apply itself (what fast_linear calls for fp32 CPU tensors)."""
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(3, 6, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    grads = torch.autograd.grad(OneDNNLinearFunction.apply(x, w, b).pow(2).sum(), (x, w, b))
    expected = torch.autograd.grad(F.linear(x, w, b).pow(2).sum(), (x, w, b))
    for g, e in zip(grads, expected):
        _rel_close(g, e)


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    n_in=st.integers(1, 33),
    n_out=st.integers(1, 33),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_f_linear(lead, n_in, n_out, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    args = [t.clone().requires_grad_() for t in (x, w)]
    ref_args = [t.clone().requires_grad_() for t in (x, w)]
    b_fast = b.clone().requires_grad_() if bias else None
    b_ref = b.clone().requires_grad_() if bias else None
    y = fast_linear(*args, b_fast)
    y_ref = F.linear(*ref_args, b_ref)
    # Random shapes give outputs that cancel (sums of n_in terms near 0): relative to the
    # largest output, the summation-order difference reached 1.9e-5 once (a bare-copy run).
    _rel_close(y, y_ref, PROPERTY_RTOL)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    y_ref.backward(g)
    for t, t_ref in zip(args + [b_fast], ref_args + [b_ref]):
        if t is not None:
            _rel_close(t.grad, t_ref.grad, PROPERTY_RTOL)


# --- the swap ---------------------------------------------------------------------------------
def _tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_preset("gpt2-tiny"))


def test_tied_head_gradients_match():
    """GPT-2's head shares the embedding matrix: its gradient sums both uses, as with nn.Linear."""
    ref, fast = _tiny_gpt2(), _tiny_gpt2()
    assert fast.head.weight is fast.embed.weight
    assert enable_fast_linear(fast) > 0
    assert type(fast.head) is FastLinear and fast.head.weight is fast.embed.weight
    ids = torch.randint(0, 256, (2, 8))
    targets = torch.randint(0, 256, (2, 8))
    loss_ref, loss_fast = clm_loss(ref(ids), targets), clm_loss(fast(ids), targets)
    _rel_close(loss_fast, loss_ref)
    loss_ref.backward()
    loss_fast.backward()
    # k_proj's bias has a zero gradient in exact arithmetic (a constant added to every score of
    # a row cancels in the softmax), so its rounding noise is compared to a floor, not to itself.
    for p_ref, p_fast in zip(ref.parameters(), fast.parameters()):
        _rel_close(p_fast.grad, p_ref.grad, floor=1e-3)
    _rel_close(fast.embed.weight.grad, ref.embed.weight.grad)  # embedding + head, summed


def test_swap_keeps_parameters_state_dict_and_optimizer():
    model = _tiny_gpt2()
    old = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.99))
    swapped = enable_fast_linear(model)
    assert swapped == len({id(m) for m in old.values()})
    for name, m in old.items():  # new module objects in place; the old ones keep their class
        assert type(model.get_submodule(name)) is FastLinear and type(m) is nn.Linear
    assert all(p is params[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in params.values()}
    assert enable_fast_linear(model) == 0  # already swapped
    assert disable_fast_linear(model) == swapped
    assert all(type(model.get_submodule(name)) is nn.Linear for name in old)
    assert all(p is params[name] for name, p in model.named_parameters())


def test_only_the_given_shapes_are_swapped():
    model = _tiny_gpt2()
    shape = (model.head.in_features, model.head.out_features, False)
    assert enable_fast_linear(model, shapes=[shape]) == 1
    assert [name for name, m in model.named_modules() if type(m) is FastLinear] == ["head"]


def test_training_steps_match_after_swap():
    """Three steps of attnlab's step (clm_loss, clip, fused AdamW) give the same losses.

    Parameters are not compared elementwise: AdamW's first update is about lr * sign(grad), so a
    gradient that is zero up to rounding (k_proj's bias) may move either way in either model."""
    ref, fast = _tiny_gpt2(), _tiny_gpt2()
    enable_fast_linear(fast)
    ids, targets = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    losses = {}
    for name, model in (("ref", ref), ("fast", fast)):
        opt = build_optimizer(model, 1e-3, 0.1, (0.9, 0.99))
        losses[name] = []
        for _ in range(3):
            loss = clm_loss(model(ids), targets)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["ref"][-1] < losses["ref"][0]  # it trains
    torch.testing.assert_close(losses["fast"], losses["ref"], rtol=1e-4, atol=0)


def test_nothing_chosen_when_not_fast_enough():
    model = _tiny_gpt2()
    assert choose_fast_linear(model, rows=16, min_speedup=float("inf")) == []
    assert not any(type(m) is FastLinear for m in model.modules())  # choosing swaps nothing


def _sleepy_check(model: nn.Module, slow: type):
    """A forward + backward that takes 100 ms longer while the head is of class `slow`."""
    ids = torch.randint(0, 256, (2, 8))

    def check():
        clm_loss(model(ids), ids).backward()
        if type(model.head) is slow:
            time.sleep(0.1)

    return check


@pytest.mark.slow
@pytest.mark.parametrize("slow, expected", [(FastLinear, 0), (nn.Linear, 13)])
def test_the_whole_step_check_decides(slow, expected):
    """Shapes that pass the screen (any speed-up passes min_speedup=1e-9) are kept only if the
    model's step is faster with them swapped."""
    model = _tiny_gpt2()
    check = _sleepy_check(model, slow)
    rng = torch.get_rng_state()
    shapes = choose_fast_linear(model, 16, check=check, min_speedup=1e-9, min_step_speedup=1.03)
    assert enable_fast_linear(model, shapes) == expected
    assert sum(type(m) is FastLinear for m in model.modules()) == expected
    assert all(p.grad is None for p in model.parameters())  # the check's gradients are gone
    assert torch.equal(torch.get_rng_state(), rng)  # and it drew nothing from the global RNG


def test_subclasses_of_linear_are_left_alone():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(Custom(4, 4), nn.Linear(4, 4))
    assert enable_fast_linear(model) == 1
    assert type(model[0]) is Custom and type(model[1]) is FastLinear


def test_measure_speedup_is_a_positive_ratio():
    speedup = measure_speedup(16, 8, True, rows=32, repeats=3)
    assert 0 < speedup < float("inf")


def test_rows_must_be_positive():
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        choose_fast_linear(nn.Linear(2, 2), rows=0)


@pytest.mark.slow
@pytest.mark.parametrize("slow, expected", [(FastLinear, 0), (nn.Linear, 13)])
def test_for_inference_no_shape_is_screened_and_the_check_decides(slow, expected, monkeypatch):
    def no_screening(*args, **kwargs):
        raise AssertionError("inference must not time shapes alone")

    monkeypatch.setattr(fl, "measure_speedup", no_screening)
    model = _tiny_gpt2().eval()
    ids = torch.randint(0, 256, (1, 8))

    def check():  # a forward, as decoding runs; 100 ms slower while the head is `slow`
        with torch.no_grad():
            model(ids)
        if type(model.head) is slow:
            time.sleep(0.1)

    shapes = choose_fast_linear(model, rows=1, check=check, inference=True)
    assert enable_fast_linear(model, shapes) == expected


def test_greedy_decoding_is_unchanged_by_the_swap():
    torch.manual_seed(0)
    model = _tiny_gpt2().eval()
    prompt, greedy = [[5, 6, 7, 8]], SamplingConfig(temperature=0.0)
    before = generate(model, prompt, GenerationConfig(12, greedy))
    assert enable_fast_linear(model) == 13
    assert generate(model, prompt, GenerationConfig(12, greedy)) == before


def test_inference_needs_a_check():
    with pytest.raises(ValueError, match="needs a check"):
        choose_fast_linear(nn.Linear(2, 2), rows=1, inference=True)


def test_enabling_times_nothing(monkeypatch):
    # The switch is deterministic: no timing decides which path runs (numerics never depend on
    # the machine's load); timing happens only in choose_fast_linear, when asked for.
    def no_timing(*args, **kwargs):
        raise AssertionError("enable_fast_linear must not time anything")

    monkeypatch.setattr(fl, "measure_speedup", no_timing)
    monkeypatch.setattr(fl, "measure_step_speedup", no_timing)
    monkeypatch.setattr(fl.time, "perf_counter", no_timing)
    assert enable_fast_linear(_tiny_gpt2()) == 13
