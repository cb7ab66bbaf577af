"""A mask_mod (b, h, i, j) -> bool reaches every attention layer of DecoderLM and Encoder
(issue 20 item 4): as a BlockMask built once per forward on the flex backend, else as the dense
mask it evaluates to.

References: the causal path for a causal mask_mod; the dense document mask written out with
Python loops from its definition; the dense-mask path (tests/models/test_custom_masks.py) for
the encoder.
"""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from attnlab.components.masks import causal_mask_mod, document_mask_mod
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset

V, T = 32, 10
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])


def _model(preset: str, backend: str = "sdpa"):
    torch.manual_seed(0)
    cfg = get_preset(preset)
    cfg = replace(cfg, vocab_size=V, attention=replace(cfg.attention, backend=backend))
    return build_model(cfg).eval()


def _document_mask_by_loops(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    B, n = doc.shape
    mask = torch.zeros(B, n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            for j in range(n):
                mask[b, i, j] = doc[b, i] == doc[b, j] and (j <= i or not causal)
    return mask


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_a_causal_mask_mod_gives_the_causal_models_logits(preset):
    model = _model(preset)
    ids = torch.randint(0, V, (2, T))
    pad = torch.tensor([[True] * T, [True] * 7 + [False] * 3])
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, pad, attn_mask=causal_mask_mod()), model(ids, pad), atol=1e-5, rtol=0
        )


def test_a_mask_mod_becomes_the_dense_mask_it_defines():
    model = _model("llama-tiny")
    ids = torch.randint(0, V, (2, T))
    ctx, _ = model.context(ids, None, None, None, None, None, None, document_mask_mod(DOCS))
    expected = _document_mask_by_loops(DOCS, causal=True)[:, None]  # (B, 1, T, T)
    assert torch.equal(ctx.mask.expand(2, 1, T, T), expected) and not ctx.is_causal
    with torch.no_grad():
        got = model(ids, attn_mask=document_mask_mod(DOCS))
        ref = model(ids, attn_mask=expected[:, 0])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_flex_layers_get_one_block_mask_with_the_padding():
    model = _model("llama-tiny", backend="flex")
    ids = torch.randint(0, V, (2, T))
    pad = torch.tensor([[True] * T, [True] * 8 + [False] * 2])
    ctx, _ = model.context(ids, pad, None, None, None, None, None, document_mask_mod(DOCS))
    assert isinstance(ctx.mask, BlockMask) and tuple(ctx.mask.shape) == (2, 1, T, T)
    b, h, i, j = (
        torch.arange(n).view([-1 if d == k else 1 for d in range(4)])
        for k, n in enumerate((2, 1, T, T))
    )
    dense = ctx.mask.mask_mod(b, h, i, j)[:, 0]  # (B, T, T)
    expected = _document_mask_by_loops(DOCS, causal=True) & pad[:, None, :]
    assert torch.equal(dense.expand(2, T, T), expected)


def test_flex_says_which_mask_mod_did_not_fit():
    model = _model("llama-tiny", backend="flex")
    ids = torch.randint(0, V, (2, T))
    with pytest.raises(ValueError, match="mask_mod failed on a batch of B=2, T=10"):
        model.context(ids, None, None, None, None, None, None, document_mask_mod(DOCS[:, :4]))


def test_encoder_takes_a_bidirectional_document_mask_mod():
    model = _model("bert-tiny")
    encoder = model.encoder if hasattr(model, "encoder") else model
    ids = torch.randint(0, V, (2, T))
    pad = torch.tensor([[True] * T, [True] * 8 + [False] * 2])
    dense = _document_mask_by_loops(DOCS, causal=False)
    with torch.no_grad():
        got = encoder(ids, pad, attn_mask=document_mask_mod(DOCS, causal=False))
        ref = encoder(ids, pad, attn_mask=dense)
        full = encoder(ids, pad)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(got, full, atol=1e-3)  # the mask reached the layers


def test_mask_mod_misuse_is_one_clear_error():
    model = _model("llama-tiny")
    ids = torch.randint(0, V, (2, T))
    with pytest.raises(ValueError, match="mask_mod failed on a batch of B=2, T=10"):
        model(ids, attn_mask=document_mask_mod(DOCS[:, :4]))  # doc ids of another length
    with pytest.raises(ValueError, match="must return bool"):
        model(ids, attn_mask=lambda b, h, i, j: (j <= i).float())
    with pytest.raises(ValueError, match=r"returned shape \(3, 10, 10\), which does not"):
        model(ids, attn_mask=lambda b, h, i, j: torch.ones(3, T, T, dtype=torch.bool))
    cache = model.make_cache(2, T) if hasattr(model, "make_cache") else object()
    with pytest.raises(ValueError, match="attn_mask cannot be used with a KV cache"):
        model(ids, attn_mask=causal_mask_mod(), cache=cache, slots=torch.arange(T))
