"""lab/patching.py: activation patching, direct logit attribution and the logit lens, checked
against the unpatched runs, today's head mask and the logits themselves."""

import pytest
import torch

from attnlab.components.hooks import hooks, run_with_cache
from attnlab.lab.head_masks import set_head_mask
from attnlab.lab.patching import (
    _patch_at,
    attribution_names,
    lens_names,
    logit_attribution,
    logit_diff,
    logit_lens,
    normalised,
    patch,
    patch_names,
    patching_experiment,
)
from tests.lab.helpers import tiny_lm

PRESETS = ["gpt2-tiny", "llama-tiny"]  # LayerNorm + learned positions; RMSNorm + RoPE + GQA
CLEAN = torch.tensor([[5, 17, 30, 44, 9, 12]])
CORRUPT = torch.tensor([[5, 17, 31, 44, 9, 12]])  # one token differs, at position 2
ANSWER, WRONG = 7, 8


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("kind", ["resid_pre", "attn_out", "mlp_out", "head"])
def test_patching_every_cell_of_a_layer(preset, kind):
    """Every cell of a layer patched at once is the whole clean activation there: for the
    residual stream that is the clean run (logits equal), for the others the clean tensor
    written over the corrupted one."""
    model = tiny_lm(preset)
    names = patch_names(model, kind)
    clean, cache = run_with_cache(model, CLEAN, names=names)
    cells = cache[names[1]].shape[1]  # positions, or heads for hook_z
    for name in names:
        at = [
            (name, _patch_at(cache[name], *((None, c) if kind == "head" else (c, None))))
            for c in range(cells)
        ]
        with torch.no_grad(), hooks(model, at):
            patched = model(CORRUPT)
        with torch.no_grad(), hooks(model, [(name, lambda x, h, n=name: cache[n])]):
            whole = model(CORRUPT)
        assert torch.equal(patched, whole)
        if kind == "resid_pre":
            assert torch.equal(patched, clean)


@pytest.mark.parametrize("preset", PRESETS)
def test_residual_patching_map(preset):
    model = tiny_lm(preset)
    clean, cache = run_with_cache(model, CLEAN, names=patch_names(model, "resid_pre"))
    c, k = logit_diff(clean, ANSWER, WRONG).item(), logit_diff(model(CORRUPT), ANSWER, WRONG).item()
    metric = lambda logits: normalised(logit_diff(logits, ANSWER, WRONG), c, k)  # noqa: E731
    grid = patch(model, CORRUPT, cache, metric, "resid_pre")  # (L, T)
    assert grid.shape == (2, 6)
    # Layer 0: the stream is the embeddings, so only the changed token matters, and it is all
    # of the difference; positions before it see nothing of it.
    assert grid[0, 2].item() == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(grid[0, [0, 1, 3, 4, 5]], torch.zeros(5), atol=1e-5)
    assert torch.allclose(grid[:, :2], torch.zeros(2, 2), atol=1e-5)  # before the change: nothing
    assert grid[:, -1].abs().max() > 0  # the last position carries it in every layer


@pytest.mark.parametrize("preset", PRESETS)
def test_dla_sums_to_the_logit_difference(preset):
    model = tiny_lm(preset)
    logits, cache = run_with_cache(model, CLEAN, names=attribution_names(model))
    dla = logit_attribution(model, cache, ANSWER, WRONG)
    assert dla["total"].item() == pytest.approx(logit_diff(logits, ANSWER, WRONG).item(), abs=1e-4)
    assert dla["heads"].shape == (2, 4) and dla["layers"].shape == (2, 2)
    one = logit_attribution(model, cache, ANSWER)  # the logit itself
    assert one["total"].item() == pytest.approx(logits[0, -1, ANSWER].item(), abs=1e-4)


@pytest.mark.parametrize("preset", PRESETS)
def test_zero_ablated_head_equals_head_mask(preset):
    model = tiny_lm(preset)

    def zero(z, hook):
        z = z.clone()
        z[:, 3] = 0
        return z

    with torch.no_grad(), hooks(model, [("blocks.1.self_attn.hook_z", zero)]):
        ablated = model(CLEAN)
    mask = torch.ones(2, 4)
    mask[1, 3] = 0
    set_head_mask(model, mask)
    with torch.no_grad():
        masked = model(CLEAN)
    set_head_mask(model, None)
    assert torch.equal(ablated, masked)
    assert not torch.equal(ablated, model(CLEAN))


def test_logit_lens_last_row_is_the_model():
    model = tiny_lm("gpt2-tiny")
    logits, cache = run_with_cache(model, CLEAN, names=lens_names(model))
    lens = logit_lens(model, cache, ANSWER, WRONG)
    assert lens.shape == (3,)
    assert lens[-1].item() == pytest.approx(logit_diff(logits, ANSWER, WRONG).item(), abs=1e-5)


def test_experiment_and_bad_input():
    model = tiny_lm("gpt2-tiny")
    result = patching_experiment(model, CLEAN, CORRUPT, ANSWER, WRONG)
    assert set(result["patching"]) == {"resid_pre", "attn_out", "mlp_out", "head"}
    assert result["patching"]["head"].shape == (2, 4)
    with pytest.raises(ValueError, match="same length"):
        patching_experiment(model, CLEAN, CORRUPT[:, :5], ANSWER, WRONG)
    with pytest.raises(ValueError, match="unknown patching kind"):
        patch_names(model, "resid_middle")
    with pytest.raises(ValueError, match="same metric"):
        patching_experiment(model, CLEAN, CLEAN, ANSWER, WRONG)
