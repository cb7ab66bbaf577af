"""lab/patching.py against TransformerLens on the same GPT-2-shaped weights: attnlab's model
exported to HF (interop save_hf) and opened offline by TransformerLens' TransformerBridge (the
4.x successor of HookedTransformer, here without weight processing)."""

from dataclasses import replace

import pytest
import torch

from attnlab.components.hooks import run_with_cache
from attnlab.interop.hf import save_hf
from attnlab.lab.patching import (
    attribution_names,
    logit_attribution,
    logit_diff,
    patch,
    patch_names,
)
from attnlab.models.presets import get_preset
from tests.lab.helpers import tiny_lm

T = pytest.importorskip("transformers")
tl_patching = pytest.importorskip("transformer_lens.patching")
pytestmark = [pytest.mark.hf, pytest.mark.slow]

CLEAN = torch.tensor([[5, 17, 30, 44, 9, 12, 3, 60]])
CORRUPT = torch.tensor([[5, 17, 31, 44, 9, 12, 3, 60]])
ANSWER, WRONG = 7, 8
TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformer_lens.model_bridge import TransformerBridge

    model = tiny_lm("gpt2-tiny", n_layers=3)
    path = tmp_path_factory.mktemp("gpt2")
    save_hf(model, replace(get_preset("gpt2-tiny"), n_layers=3), path)
    hf = T.GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager").eval()
    with pytest.MonkeyPatch.context() as env:  # nothing is fetched: the model is local
        env.setenv("HF_HUB_OFFLINE", "1")
        bridge = TransformerBridge.boot_transformers(str(path), hf_model=hf)
    return model, bridge


def test_residual_stream_and_patterns(pair):
    model, bridge = pair
    _, theirs = bridge.run_with_cache(CLEAN)
    _, ours = run_with_cache(model, CLEAN)
    for i in range(len(model.blocks)):
        for point in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post"):
            a, b = ours[f"blocks.{i}.{point}"], theirs[f"blocks.{i}.{point}"]
            assert (a - b).abs().max() < TOL, (i, point)
        a, b = ours[f"blocks.{i}.self_attn.hook_pattern"], theirs[f"blocks.{i}.attn.hook_pattern"]
        assert (a - b).abs().max() < TOL, i


def test_per_head_dla(pair):
    """TransformerLens' head results through apply_ln_to_stack (the frozen final-norm scale),
    the norm's weight, and the unembedding direction."""
    model, bridge = pair
    _, theirs = bridge.run_with_cache(CLEAN)
    stack = theirs.stack_head_results(layer=-1, pos_slice=-1)  # (L*H, B, C)
    normed = theirs.apply_ln_to_stack(stack, layer=-1, pos_slice=-1) * model.norm.weight
    direction = bridge.W_U[:, ANSWER] - bridge.W_U[:, WRONG]  # (C,)
    reference = (normed @ direction).mean(-1).view(len(model.blocks), -1)  # (L, H)
    logits, ours = run_with_cache(model, CLEAN, names=attribution_names(model))
    dla = logit_attribution(model, ours, ANSWER, WRONG)
    assert (dla["heads"] - reference).abs().max() < TOL
    assert dla["total"].item() == pytest.approx(logit_diff(logits, ANSWER, WRONG).item(), abs=TOL)


def test_residual_patching_equals_transformer_lens(pair):
    model, bridge = pair
    _, their_cache = bridge.run_with_cache(CLEAN)

    def metric(logits):
        return logit_diff(logits, ANSWER, WRONG)

    reference = tl_patching.get_act_patch_resid_pre(bridge, CORRUPT, their_cache, metric)
    _, cache = run_with_cache(model, CLEAN, names=patch_names(model, "resid_pre"))
    ours = patch(model, CORRUPT, cache, metric, "resid_pre")  # (L, T)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max() < TOL
    attn_ref = tl_patching.get_act_patch_attn_out(bridge, CORRUPT, their_cache, metric)
    _, cache = run_with_cache(model, CLEAN, names=patch_names(model, "attn_out"))
    assert (patch(model, CORRUPT, cache, metric, "attn_out") - attn_ref).abs().max() < TOL
