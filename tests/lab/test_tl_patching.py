"""lab/tl_patching.py against transformer_lens.patching, function by function, on the same
weights: attnlab's tiny GPT-2 (every parameter drawn at random) exported to HF and opened
offline by TransformerLens' TransformerBridge, the same corrupted prompt and metric."""

import pytest
import torch

from attnlab.components.hooks import run_with_cache
from attnlab.lab import tl_patching
from attnlab.lab.patching import logit_diff
from tests.components.test_tl_names import _pair

tl_patching_ref = pytest.importorskip("transformer_lens.patching")
pytestmark = [pytest.mark.hf, pytest.mark.slow]

CLEAN = torch.tensor([[5, 17, 30, 44, 9, 60]])
CORRUPT = torch.tensor([[5, 17, 31, 44, 9, 60]])
TOL = 1e-5
FUNCTIONS = [
    "get_act_patch_resid_pre",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_block_every",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
]


def metric(logits):
    return logit_diff(logits, 7, 8)  # the last position's (BERT: its masked-LM logits)


@pytest.fixture(scope="module", params=["gpt2-tiny", "llama-tiny", "bert-tiny"])
def runs(request, tmp_path_factory):
    model, bridge = _pair(request.param, tmp_path_factory.mktemp(request.param))
    _, theirs = bridge.run_with_cache(CLEAN)
    _, ours = run_with_cache(model, CLEAN, names=tl_patching.tl_patch_names(model))
    return model, bridge, ours, theirs


@pytest.mark.parametrize("name", FUNCTIONS)
def test_equals_transformer_lens(runs, name):
    model, bridge, ours, theirs = runs
    if name == "get_act_patch_resid_mid" and not hasattr(model, "encoder"):
        pytest.skip("TransformerBridge patches the MLP's input only: test_resid_mid below")
    reference = getattr(tl_patching_ref, name)(bridge, CORRUPT, theirs, metric)
    result = getattr(tl_patching, name)(model, CORRUPT, ours, metric)
    assert result.shape == reference.shape
    if hasattr(model, "encoder") and "pattern" in name:
        # TransformerBridge 4.3's BERT attention (its generic AttentionBridge) shows the
        # pattern to hooks but attends with its own: an edit there changes nothing, and its
        # map is flat. attnlab's heads read the edited pattern.
        assert reference.max() - reference.min() < 1e-6 and result.std() > 0
        return
    if hasattr(model, "encoder") and name.endswith("_every") and "head" in name:
        result, reference = result[:4], reference[:4]  # out, q, k, v; the pattern as above
    assert (result - reference).abs().max() <= TOL
    assert reference.std() > 0  # the map is not flat: the cells differ


def test_resid_mid(runs):
    """TransformerBridge 4.3's `hook_resid_mid` is its ln2's input: an edit there reaches the
    MLP and not the residual stream (resid_post stays the unedited resid_mid plus mlp_out), so
    its get_act_patch_resid_mid differs from HookedTransformer's (up to 0.011 here). The
    reference is the bridge patched as HookedTransformer was: the clean value into the MLP's
    input and the same change added to the stream after the MLP."""
    model, bridge, ours, theirs = runs
    if hasattr(model, "encoder"):
        pytest.skip("BERT's hook_resid_mid is its second norm's input in both: patched above")
    _, corrupt = bridge.run_with_cache(CORRUPT)
    L, T = len(model.blocks), CORRUPT.shape[1]
    reference = torch.zeros(L, T)
    for layer in range(L):
        mid = f"blocks.{layer}.hook_resid_mid"
        delta = theirs[mid] - corrupt[mid]  # (B, T, C)
        for pos in range(T):

            def into_mlp(x, hook, pos=pos, mid=mid):
                x = x.clone()
                x[:, pos] = theirs[mid][:, pos]
                return x

            def into_stream(x, hook, pos=pos, delta=delta):
                x = x.clone()
                x[:, pos] += delta[:, pos]
                return x

            fwd = [(mid, into_mlp), (f"blocks.{layer}.hook_resid_post", into_stream)]
            reference[layer, pos] = metric(bridge.run_with_hooks(CORRUPT, fwd_hooks=fwd))
    result = tl_patching.get_act_patch_resid_mid(model, CORRUPT, ours, metric)
    assert (result - reference).abs().max() <= TOL
    bridge_own = tl_patching_ref.get_act_patch_resid_mid(bridge, CORRUPT, theirs, metric)
    assert (result - bridge_own).abs().max() > 1e-3  # the difference this test is about


def test_a_cache_without_the_name_is_an_error(runs):
    model = runs[0]
    with pytest.raises(ValueError, match="lacks 'blocks.0.hook_resid_mid'"):
        tl_patching.get_act_patch_resid_mid(model, CORRUPT, {}, metric)


def test_per_layer_attribution_counts_the_output_bias(runs):
    """logit_attribution's per-layer attention column is TransformerLens' `attn_out` term of
    decompose_resid (the heads and the o_proj bias b_O), through apply_ln_to_stack."""
    from attnlab.lab.patching import attribution_names, logit_attribution

    model, bridge, _, theirs = runs
    if hasattr(model, "encoder"):
        pytest.skip("direct logit attribution takes a pre-norm causal LM")
    stack, labels = theirs.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    normed = theirs.apply_ln_to_stack(stack, layer=-1, pos_slice=-1) * model.norm.weight
    direction = bridge.W_U[:, 7] - bridge.W_U[:, 8]  # (C,)
    terms = dict(zip(labels, (normed @ direction).mean(-1)))  # label -> scalar
    _, cache = run_with_cache(model, CLEAN, names=attribution_names(model))
    dla = logit_attribution(model, cache, 7, 8)
    for i in range(len(model.blocks)):
        assert abs(dla["layers"][i, 0] - terms[f"{i}_attn_out"]) <= TOL
        assert abs(dla["layers"][i, 1] - terms[f"{i}_mlp_out"]) <= TOL
    bias = model.blocks[0].self_attn.o_proj.bias
    if bias is not None:  # the bias's own share is not small on these weights
        assert abs(dla["layers"][0, 0] - dla["heads"][0].sum()) > 1e-3
