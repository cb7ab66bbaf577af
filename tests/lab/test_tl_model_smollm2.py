"""TransformerLens-style analysis code on SmolLM2-135M-Instruct through HookedModel: a logit
difference, the logit lens, the residual decomposition and per-head attribution, activation
patching, induction heads and a head ablation, written as for TransformerLens (its names,
its layouts, its cache methods); only the loading line is attnlab's. Each reading is checked
against what must hold on the real model (the decompositions add up to the model's own logit
difference; a patch of the whole clean stream restores the clean answer)."""

import time
from functools import partial

import pytest
import torch

from attnlab.components.tl_names import get_act_name
from attnlab.lab.tl_model import HookedModel
from tests.realmodel import open_smollm2

pytestmark = pytest.mark.slow
TOL = 1e-3  # 30 layers of fp32 on a 49152-word vocabulary


@pytest.fixture(scope="module")
def model():
    loaded = open_smollm2()
    return HookedModel(loaded.model, loaded.tokenizer)  # the loading line


def test_ioi_attribution_and_patching(model):
    start = time.perf_counter()
    prompt = "When Mary and John went to the store, John gave a drink to"
    corrupt = "When Mary and John went to the store, Mary gave a drink to"
    answers = [model.to_single_token(" Mary"), model.to_single_token(" John")]
    tokens, corrupted = model.to_tokens(prompt), model.to_tokens(corrupt)
    logits, cache = model.run_with_cache(tokens)
    direction = model.tokens_to_residual_directions(
        answers[0]
    ) - model.tokens_to_residual_directions(answers[1])
    logit_diff = logits[0, -1, answers[0]] - logits[0, -1, answers[1]]
    assert logit_diff > 0  # SmolLM2 prefers the indirect object

    # Logit lens: the last stream through the final norm is the model's own logit difference.
    lens, labels = model.run_with_cache(tokens)[1].accumulated_resid(
        apply_ln=True, pos_slice=-1, return_labels=True
    )
    lens_diff = lens[:, 0] @ direction  # (L + 1,)
    assert labels[-1] == "final_post" and abs(lens_diff[-1] - logit_diff) < TOL

    # Decomposition and per-head attribution, through the final norm's frozen scale.
    w = model.model.norm.weight
    parts, names = cache.decompose_resid(apply_ln=True, pos_slice=-1, return_labels=True)
    parts = parts * w  # (N, B, C)
    assert abs((parts[:, 0] @ direction).sum() - logit_diff) < TOL
    heads = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True) * w
    per_head = (heads[:, 0] @ direction).view(model.cfg.n_layers, model.cfg.n_heads)
    attn = torch.stack(
        [parts[names.index(f"{i}_attn_out"), 0] @ direction for i in range(model.cfg.n_layers)]
    )
    assert (per_head.sum(1) - attn).abs().max() < TOL  # no output bias in SmolLM2

    # Activation patching of the residual stream, as a TransformerLens hook with partial, at
    # the changed name and at the last position (get_act_patch_resid_pre would take 450
    # forwards here; tests/lab/test_tl_patching.py checks it against TransformerLens).
    corrupt_logits = model(corrupted)
    corrupt_diff = corrupt_logits[0, -1, answers[0]] - corrupt_logits[0, -1, answers[1]]

    def patch_resid(resid, hook, pos):
        resid[:, pos] = cache[hook.name][:, pos]
        return resid

    changed = int((tokens != corrupted).nonzero()[0, 1])
    grid = torch.zeros(model.cfg.n_layers, 2)
    for layer in range(model.cfg.n_layers):
        for j, pos in enumerate((changed, -1)):
            hook = (get_act_name("resid_pre", layer), partial(patch_resid, pos=pos))
            patched = model.run_with_hooks(corrupted, fwd_hooks=[hook])
            d = patched[0, -1, answers[0]] - patched[0, -1, answers[1]]
            grid[layer, j] = (d - corrupt_diff) / (logit_diff - corrupt_diff)
    assert abs(grid[0, 0] - 1) < TOL  # the whole clean difference enters at the name
    assert abs(grid[-1, 1] - 1) < 0.05  # and has moved to the last position by the end
    moved = int((grid[:, 1] > grid[:, 0]).nonzero()[0])
    top = [divmod(int(i), model.cfg.n_heads) for i in per_head.flatten().topk(3).indices]
    print(
        f"\nIOI on SmolLM2: logit diff {logit_diff:.3f} (corrupted {corrupt_diff:.3f}); "
        f"top heads (layer, head) {top}; the last position carries more from block {moved}; "
        f"{time.perf_counter() - start:.1f} s"
    )


def test_induction_heads_and_ablation(model):
    torch.manual_seed(0)
    half = torch.randint(1000, 10000, (4, 20))
    bos = torch.full((4, 1), model.tokenizer.token_id("<bos>"))
    tokens = torch.cat([bos, half, half], dim=1)  # (4, 41): a random half, then again
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    scores = torch.stack(
        [
            cache["pattern", i].diagonal(offset=-19, dim1=-2, dim2=-1)[..., 1:].mean((0, 2))
            for i in range(model.cfg.n_layers)
        ]
    )  # (L, H): attention from each repeated token to the one after its first copy
    layer, head = divmod(int(scores.argmax()), model.cfg.n_heads)
    assert scores.max() > 0.3

    def ablate(z, hook):
        z[:, :, head] = 0.0
        return z

    loss = model(tokens, return_type="loss")
    ablated = model.run_with_hooks(
        tokens, return_type="loss", fwd_hooks=[(get_act_name("z", layer), ablate)]
    )
    print(
        f"\ninduction: best head L{layer}H{head} score {scores.max():.2f}; "
        f"{int((scores > 0.3).sum())} heads over 0.3; loss {loss:.3f} -> {ablated:.3f} ablated"
    )
    assert ablated > loss
