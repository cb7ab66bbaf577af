"""lab/tl_model.py against TransformerLens' own ActivationCache (TransformerBridge 4.3) on the
same randomised tiny GPT-2 and Llama weights: each residual-stream reading, and TL-style hook
code run through HookedModel."""

import pytest
import torch

from attnlab.lab.tl_model import HookedModel
from tests.components.test_tl_names import _pair

pytest.importorskip("transformer_lens")
pytestmark = [pytest.mark.hf, pytest.mark.slow]

TOKENS = torch.tensor([[5, 17, 30, 44, 9, 60, 3], [8, 2, 71, 44, 13, 6, 90]])
TOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2-tiny", "llama-tiny"])
def runs(request, tmp_path_factory):
    model, bridge = _pair(request.param, tmp_path_factory.mktemp(request.param))
    ours = HookedModel(model)
    logits, cache = ours.run_with_cache(TOKENS)
    ref_logits, ref = bridge.run_with_cache(TOKENS)
    assert (logits - ref_logits).abs().max() < TOL
    return ours, bridge, cache, ref


def _same(a, b):
    (x, xl), (y, yl) = a, b
    assert xl == yl
    assert x.shape == y.shape and (x - y).abs().max() <= TOL, (x - y).abs().max()


@pytest.mark.parametrize("layer", [None, 1])
@pytest.mark.parametrize("pos_slice", [None, -1])
def test_accumulated_and_decomposed_resid(runs, layer, pos_slice):
    _, _, cache, ref = runs
    for incl_mid in (False, True):
        kw = dict(layer=layer, incl_mid=incl_mid, apply_ln=True, pos_slice=pos_slice)
        _same(
            cache.accumulated_resid(**kw, return_labels=True),
            ref.accumulated_resid(**kw, return_labels=True),
        )
    kw = dict(layer=layer, apply_ln=True, pos_slice=pos_slice, return_labels=True)
    _same(cache.decompose_resid(**kw), ref.decompose_resid(**kw))


@pytest.mark.parametrize("layer", [-1, 1])
def test_stack_head_results(runs, layer):
    _, _, cache, ref = runs
    kw = dict(layer=layer, pos_slice=-1, apply_ln=True, return_labels=True)
    _same(cache.stack_head_results(**kw), ref.stack_head_results(**kw))


def test_keys_by_short_name_and_hooks(runs):
    ours, bridge, cache, ref = runs
    assert torch.equal(cache["pattern", -1], cache["blocks.1.attn.hook_pattern"])
    assert (cache["scale", 0, "ln1"] - ref["blocks.0.ln1.hook_scale"]).abs().max() <= TOL

    def ablate_head(z, hook, head=1):  # TL-style hook: (B, T, H, D)
        z[:, :, head] = 0.0
        return z

    fwd = [("blocks.0.attn.hook_z", ablate_head)]
    loss = ours.run_with_hooks(TOKENS, return_type="loss", fwd_hooks=fwd)
    ref_loss = bridge.run_with_hooks(TOKENS, return_type="loss", fwd_hooks=fwd)
    assert abs(loss.item() - ref_loss.item()) <= TOL
    assert (
        abs(ours(TOKENS, return_type="loss").item() - bridge(TOKENS, return_type="loss").item())
        <= TOL
    )


def test_patching_takes_the_hooked_model(runs):
    import transformer_lens.patching as reference

    from attnlab.lab import tl_patching

    ours, bridge, cache, ref = runs
    corrupt = TOKENS.clone()
    corrupt[:, 2] = 31

    def metric(logits):
        return (logits[:, -1, 7] - logits[:, -1, 8]).mean()

    result = tl_patching.get_act_patch_attn_head_out_all_pos(ours, corrupt, cache, metric)

    expected = reference.get_act_patch_attn_head_out_all_pos(bridge, corrupt, ref, metric)
    assert (result - expected).abs().max() <= TOL
