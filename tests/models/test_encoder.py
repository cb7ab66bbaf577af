"""Encoder, EncoderForMLM and EncoderForClassification: contract, padding, input validation."""

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.encoder import EncoderForClassification, EncoderForMLM
from attnlab.models.presets import get_preset

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"]
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
V = 40


def encoder_cfg(position="learned", kv="mha", ffn="mlp", placement="post", backend="sdpa", **kw):
    return ModelConfig(
        arch="encoder",
        d_model=32,
        n_layers=2,
        vocab_size=V,
        max_seq_len=16,
        attention=AttentionConfig(n_heads=4, n_kv_heads=KV_HEADS[kv], backend=backend),
        position=position,
        ffn=ffn,
        norm="layernorm",
        norm_placement=placement,
        d_ff=48,
        **kw,
    )


def encoder(*args, n_labels=None, **kw):
    return build_model(encoder_cfg(*args, **kw), n_labels=n_labels).eval()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kv", sorted(KV_HEADS))
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_mlm_contract(position, kv, placement):
    model = encoder(position, kv, placement=placement)
    assert isinstance(model, EncoderForMLM)
    ids = torch.randint(0, V, (3, 6))
    with torch.no_grad():
        hidden = model.encoder(ids)
        logits = model(ids)
    assert hidden.shape == (3, 6, 32) and hidden.dtype == torch.float32
    assert logits.shape == (3, 6, V) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("position", POSITIONS)
def test_bfloat16_in_bfloat16_out(position):
    model = encoder(position).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.randint(0, V, (2, 5)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_classification_head():
    cfg = get_preset("bert-tiny")
    model = build_model(cfg, n_labels=3).eval()
    assert isinstance(model, EncoderForClassification)
    ids = torch.randint(0, cfg.vocab_size, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[2, 3:] = False
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape == (4, 3) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_classification_needs_a_label():
    with pytest.raises(ValueError, match=r"n_labels must be >= 1, got 0"):
        build_model(get_preset("bert-tiny"), n_labels=0)


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_classifier_needs_an_encoder(name):
    with pytest.raises(ValueError, match=r"n_labels=3 .*arch='encoder'"):
        build_model(get_preset(name), n_labels=3)


def test_mlm_head_tied_to_embedding():
    model = build_model(get_preset("bert-tiny"))
    assert model.head.decoder.weight is model.encoder.embed.weight
    assert model.head.decoder.bias is not None  # BERT keeps a per-token output bias


def test_token_types_change_the_output():
    cfg = get_preset("bert-tiny")
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    with torch.no_grad():
        torch.testing.assert_close(model(ids, None, torch.zeros_like(ids)), model(ids))
        assert not torch.allclose(model(ids, None, types), model(ids))


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_right_padding_matches_unpadded(position, backend):
    """Padding keys are invisible: the real tokens of a padded row match the row alone."""
    model = encoder(position, backend=backend)
    ids = torch.randint(0, V, (2, 8))
    n = 5
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, n:] = False
    with torch.no_grad():
        batch = model(ids, mask)
        alone = model(ids[1:, :n])
        full = model(ids[:1])
    torch.testing.assert_close(batch[1:, :n], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[:1], full, atol=1e-5, rtol=1e-5)


def test_padding_tokens_are_ignored():
    """Whatever ids sit under the padding, the real tokens' outputs do not move."""
    model = encoder("learned")
    ids = torch.randint(0, V, (1, 8))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    other = ids.clone()
    other[0, 4:] = (ids[0, 4:] + 1) % V
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask)[:, :4], model(other, mask)[:, :4])


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_fully_padded_row_has_no_nan(position, placement):
    model = encoder(position, placement=placement)
    ids = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        assert torch.isfinite(model(ids, mask)).all()
    clf = encoder(position, placement=placement, n_labels=2)
    with torch.no_grad():
        assert torch.isfinite(clf(ids, mask)).all()


@pytest.mark.parametrize("bad", [V, -3])
def test_token_id_outside_vocabulary(bad):
    ids = torch.randint(0, V, (2, 4))
    ids[0, 1] = bad
    with pytest.raises(ValueError, match=rf"token id {bad}"):
        encoder()(ids)


def test_longer_than_position_table():
    cfg = get_preset("bert-tiny")
    with pytest.raises(ValueError, match=rf"position {cfg.max_seq_len} .*learned position table"):
        build_model(cfg)(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_bidirectional():
    """Unlike a decoder, an encoder's first token does see the last one."""
    model = encoder("rope")
    ids = torch.randint(0, V, (1, 6))
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % V
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 0], model(other)[:, 0])
