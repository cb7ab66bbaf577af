"""A caller's (T, T) or (B, T, T) attention mask reaches every attention layer (issue 20 item 4).

References: today's causal path (itself checked against `transformers` elsewhere) for a causal
`attn_mask`; the masks' own definitions (UniLM's prefix-LM, XLNet's permutation order) for which
outputs may and may not depend on which tokens.
"""

from dataclasses import replace

import pytest
import torch

from attnlab.components.masks import causal_mask, permutation_mask, prefix_lm_mask
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

V, T = 32, 10


def _model(preset: str):
    torch.manual_seed(0)
    return build_model(replace(get_preset(preset), vocab_size=V)).eval()


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_a_causal_attn_mask_gives_the_causal_models_logits(preset):
    model = _model(preset)
    ids = torch.randint(0, V, (2, T))
    pad = torch.tensor([[True] * T, [True] * 7 + [False] * 3])
    with torch.no_grad():
        ref = model(ids, pad)
        got = model(ids, pad, attn_mask=causal_mask(T))
        got3 = model(ids, pad, attn_mask=causal_mask(T).expand(2, T, T))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(got3, ref, atol=1e-5, rtol=0)


def test_prefix_lm_mask_prefix_is_bidirectional_and_blind_to_the_rest():
    model, P = _model("llama-tiny"), 4
    ids = torch.randint(0, V, (1, T))
    mask = prefix_lm_mask(T, P)  # (T, T)
    later, in_prefix = ids.clone(), ids.clone()
    later[0, P + 2] = (ids[0, P + 2] + 1) % V  # a token after the prefix
    in_prefix[0, P - 1] = (ids[0, P - 1] + 1) % V  # the prefix's last token
    with torch.no_grad():
        out = model(ids, attn_mask=mask)
        out_later = model(later, attn_mask=mask)
        out_prefix = model(in_prefix, attn_mask=mask)
        causal_prefix = model(in_prefix)
        causal = model(ids)
    # A token after the prefix changes nothing before it (nor the prefix).
    torch.testing.assert_close(out_later[:, : P + 2], out[:, : P + 2], atol=1e-6, rtol=0)
    assert not torch.allclose(out_later[:, P + 2 :], out[:, P + 2 :])
    # The prefix sees itself both ways: position 0 reads the prefix's last token ...
    assert not torch.allclose(out_prefix[:, 0], out[:, 0], atol=1e-4)
    # ... which the causal model's position 0 does not: the mask reached the layers.
    torch.testing.assert_close(causal_prefix[:, 0], causal[:, 0], atol=1e-6, rtol=0)


def test_per_row_prefix_masks_equal_each_row_alone():
    model = _model("gpt2-tiny")
    ids = torch.randint(0, V, (2, T))
    lens = torch.tensor([3, 7])
    with torch.no_grad():
        both = model(ids, attn_mask=prefix_lm_mask(T, lens)[:, 0])  # (B, T, T)
        rows = [model(ids[b : b + 1], attn_mask=prefix_lm_mask(T, int(lens[b]))) for b in (0, 1)]
    torch.testing.assert_close(both, torch.cat(rows), atol=1e-5, rtol=0)


def test_permutation_mask_later_in_the_order_changes_no_earlier_output():
    model = _model("llama-tiny")
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(T, generator=g)
    mask = permutation_mask(order) | torch.eye(T, dtype=torch.bool)  # content stream
    ids = torch.randint(0, V, (1, T), generator=g)
    r = 5
    changed = ids.clone()
    changed[0, order[r]] = (ids[0, order[r]] + 1) % V
    with torch.no_grad():
        out, out_changed = model(ids, attn_mask=mask), model(changed, attn_mask=mask)
    earlier, rest = order[:r], order[r:]
    torch.testing.assert_close(out_changed[:, earlier], out[:, earlier], atol=1e-6, rtol=0)
    for p in rest.tolist():  # every position from r on in the order sees the changed token
        assert not torch.allclose(out_changed[:, p], out[:, p], atol=1e-5)


def test_encoder_attn_mask_all_true_is_bidirectional_and_a_prefix_mask_reaches_it():
    model = _model("bert-tiny")
    ids = torch.randint(0, V, (1, T))
    pad = torch.tensor([[True] * 8 + [False] * 2])
    with torch.no_grad():
        ref = model(ids, pad)
        full = model.encoder(ids, pad, attn_mask=torch.ones(T, T, dtype=torch.bool))
        full = model.head(full)
        P, later = 4, ids.clone()
        later[0, 6] = (ids[0, 6] + 1) % V
        a = model.encoder(ids, attn_mask=prefix_lm_mask(T, P))
        b = model.encoder(later, attn_mask=prefix_lm_mask(T, P))
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)


def test_bad_attn_masks_are_refused_in_one_line():
    model = _model("gpt2-tiny")
    ids = torch.randint(0, V, (2, T))
    for bad in (torch.ones(T, T), torch.ones(T, T + 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match="attn_mask must be a bool tensor"):
            model(ids, attn_mask=bad)
    cache = object()  # refused before the cache is read
    with pytest.raises(ValueError, match="KV cache"):
        model(ids, attn_mask=causal_mask(T), cache=cache, slots=torch.arange(T))


@pytest.mark.parametrize("backend", ["sdpa", "flash", pytest.param("flex", marks=pytest.mark.slow)])
def test_every_backend_gives_the_eager_paths_logits_under_a_custom_mask(backend):
    """The eager path (softmax(QK^T / sqrt(d) masked) V, written out) is the reference."""
    cfg = replace(get_preset("llama-tiny"), vocab_size=V)
    eager_cfg = replace(cfg, attention=replace(cfg.attention, backend="eager"))
    other_cfg = replace(cfg, attention=replace(cfg.attention, backend=backend))
    torch.manual_seed(0)
    eager = build_model(eager_cfg).eval()
    other = build_model(other_cfg).eval()
    other.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, T), generator=g)
    orders = [torch.randperm(T, generator=g) for _ in range(2)]
    masks = {
        "prefix": prefix_lm_mask(T, torch.tensor([2, 6]))[:, 0],
        "permutation": torch.stack(
            [permutation_mask(o) | torch.eye(T, dtype=bool) for o in orders]
        ),
    }
    pad = torch.tensor([[True] * T, [True] * 8 + [False] * 2])
    with torch.no_grad():
        for mask in masks.values():
            ref = eager(ids, pad, attn_mask=mask)
            got = other(ids, pad, attn_mask=mask)
            torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(got[1, :8], ref[1, :8], atol=1e-4, rtol=0)
