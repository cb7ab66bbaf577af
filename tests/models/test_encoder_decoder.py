"""EncoderDecoder (the 2017 Transformer, T5): contract, padding on both sides, validation."""

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.models.presets import get_preset

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"]
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
V = 30


def seq2seq(position="sinusoidal", kv="mha", placement="post", backend="sdpa", **kw):
    cfg = ModelConfig(
        arch="encoder_decoder",
        d_model=32,
        n_layers=2,
        vocab_size=V,
        max_seq_len=16,
        attention=AttentionConfig(n_heads=4, n_kv_heads=KV_HEADS[kv], backend=backend),
        position=position,
        ffn=kw.pop("ffn", "mlp"),
        norm_placement=placement,
        d_ff=48,
        **kw,
    )
    return build_model(cfg).eval()


def right_padding(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kv", sorted(KV_HEADS))
def test_contract(position, kv):
    model = seq2seq(position, kv)
    assert isinstance(model, EncoderDecoder)
    src, tgt = torch.randint(0, V, (3, 7)), torch.randint(0, V, (3, 4))
    with torch.no_grad():
        memory = model.encode(src)
        logits = model(src, tgt)
        decoded = model.decode(tgt, memory)
    assert memory.shape == (3, 7, 32) and memory.dtype == torch.float32
    assert logits.shape == (3, 4, V) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(decoded, logits)


def test_decoder_layers_can_differ():
    model = seq2seq(n_decoder_layers=3)
    assert (len(model.encoder.blocks), len(model.decoder.blocks)) == (2, 3)
    with torch.no_grad():
        assert model(torch.randint(0, V, (1, 4)), torch.randint(0, V, (1, 2))).shape == (1, 2, V)


@pytest.mark.parametrize("name", ["transformer-tiny", "t5-tiny"])
def test_presets_share_one_embedding(name):
    model = build_model(get_preset(name))
    assert model.encoder.embed is model.decoder.embed
    assert model.decoder.head.weight is model.decoder.embed.weight


@pytest.mark.parametrize("name", ["transformer-tiny", "t5-tiny"])
def test_bfloat16_in_bfloat16_out(name):
    cfg = get_preset(name)
    model = build_model(cfg).eval().to(torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 3)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_right_padding_matches_unpadded(position, backend):
    """Row 1 is padded on both sides; its real target tokens match the pair run alone."""
    model = seq2seq(position, backend=backend)
    src, tgt = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 6))
    src_mask, tgt_mask = right_padding([8, 5], 8), right_padding([6, 4], 6)
    with torch.no_grad():
        batch = model(src, tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
        alone = model(src[1:, :5], tgt[1:, :4])
        full = model(src[:1], tgt[:1])
    torch.testing.assert_close(batch[1:, :4], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[:1], full, atol=1e-5, rtol=1e-5)


def test_source_padding_is_ignored():
    """Cross-attention honours src_mask: ids under the source padding change nothing."""
    model = seq2seq()
    src, tgt = torch.randint(0, V, (1, 8)), torch.randint(0, V, (1, 3))
    other = src.clone()
    other[0, 5:] = (src[0, 5:] + 1) % V
    mask = right_padding([5], 8)
    with torch.no_grad():
        torch.testing.assert_close(
            model(src, tgt, attention_mask=mask), model(other, tgt, attention_mask=mask)
        )
        assert not torch.allclose(model(src, tgt), model(other, tgt))


def test_cross_attention_without_memory():
    model = seq2seq()
    with pytest.raises(ValueError, match=r"cross attention needs the encoder memory"):
        model.decoder(torch.randint(0, V, (1, 3)))


@pytest.mark.parametrize("side", ["src", "tgt"])
@pytest.mark.parametrize("bad", [V, -1])
def test_token_id_outside_vocabulary(side, bad):
    src, tgt = torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 3))
    (src if side == "src" else tgt)[1, 1] = bad
    with pytest.raises(ValueError, match=rf"token id {bad}"):
        seq2seq()(src, tgt)


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
@pytest.mark.parametrize("side", ["src", "tgt"])
def test_longer_than_position_table(position, side):
    long, short = torch.randint(0, V, (1, 17)), torch.randint(0, V, (1, 3))
    src, tgt = (long, short) if side == "src" else (short, long)
    with pytest.raises(ValueError, match=r"position 16"):
        seq2seq(position)(src, tgt)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_fully_padded_rows_have_no_nan(position, placement):
    model = seq2seq(position, placement=placement)
    src, tgt = torch.randint(0, V, (3, 5)), torch.randint(0, V, (3, 4))
    src_mask, tgt_mask = right_padding([0, 3, 5], 5), right_padding([2, 0, 4], 4)
    with torch.no_grad():
        assert torch.isfinite(
            model(src, tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
        ).all()


def test_causal_in_the_target():
    model = seq2seq("t5_bias")
    src, tgt = torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 6))
    other = tgt.clone()
    other[:, 3:] = (tgt[:, 3:] + 1) % V
    with torch.no_grad():
        a, b = model(src, tgt), model(src, other)
    torch.testing.assert_close(a[:, :3], b[:, :3], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 3:], b[:, 3:])
