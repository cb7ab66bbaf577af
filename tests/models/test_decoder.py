"""DecoderLM: contract (shapes, dtypes) for every variant, padding, input validation."""

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.decoder import DecoderLM
from attnlab.models.presets import get_preset

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"]
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
V = 50


def decoder(position="rope", kv="gqa", ffn="swiglu", placement="pre", backend="sdpa", **kw):
    cfg = ModelConfig(
        arch="decoder",
        d_model=32,
        n_layers=kw.pop("n_layers", 2),
        vocab_size=V,
        max_seq_len=16,
        attention=AttentionConfig(
            n_heads=4,
            n_kv_heads=KV_HEADS[kv],
            backend=backend,
            sliding_window=kw.pop("window", None),
        ),
        position=position,
        ffn=ffn,
        norm_placement=placement,
        d_ff=kw.pop("d_ff", 48),
        **kw,
    )
    return build_model(cfg).eval()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kv", sorted(KV_HEADS))
@pytest.mark.parametrize("ffn", ["mlp", "swiglu", "geglu"])
def test_contract(position, kv, ffn):
    model = decoder(position, kv, ffn)
    assert isinstance(model, DecoderLM)
    ids = torch.randint(0, V, (3, 7))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (3, 7, V) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("position", POSITIONS)
def test_bfloat16_in_bfloat16_out(position):
    model = decoder(position).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.randint(0, V, (2, 5)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_int32_ids_and_int_mask():
    model = decoder()
    ids = torch.randint(0, V, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        ref = model(ids)
        out = model(ids.int(), mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_tied_and_untied_heads():
    tied, untied = decoder(tie_embeddings=True), decoder(tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_right_padding_matches_unpadded(position, backend):
    """A right-padded row gives the same logits on its real tokens as the sequence alone."""
    model = decoder(position, backend=backend)
    ids = torch.randint(0, V, (2, 8))
    n = 5  # real tokens of row 1
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, n:] = False
    with torch.no_grad():
        batch = model(ids, mask)
        alone = model(ids[1:, :n])
        full = model(ids[:1])
    torch.testing.assert_close(batch[1:, :n], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[:1], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_fully_padded_row_has_no_nan(position):
    model = decoder(position)
    ids = torch.randint(0, V, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0] = False
    mask[2, 2:] = False
    with torch.no_grad():
        logits = model(ids, mask)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("bad", [V, V + 7, -1])
def test_token_id_outside_vocabulary(bad):
    ids = torch.randint(0, V, (2, 4))
    ids[1, 2] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} .*\[0, {V}\)"):
        decoder()(ids)


def test_float_ids_rejected():
    with pytest.raises(ValueError, match="float32"):
        decoder()(torch.zeros(1, 3))


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_longer_than_position_table(position):
    with pytest.raises(ValueError, match=r"position 16 .*16"):
        decoder(position)(torch.randint(0, V, (1, 17)))


def test_rope_and_bias_schemes_extrapolate():
    for position in ("rope", "alibi", "t5_bias", "none"):
        with torch.no_grad():
            logits = decoder(position)(torch.randint(0, V, (1, 20)))
        assert logits.shape == (1, 20, V)


def test_sliding_window_limits_the_view():
    """One layer, window 3: token t reads tokens t-2..t only, so token 0 cannot reach logit 3."""
    model = decoder(n_layers=1, window=3)
    ids = torch.randint(0, V, (1, 6))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, 3:], b[:, 3:], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 2], b[:, 2])


def test_causal():
    model = decoder()
    ids = torch.randint(0, V, (2, 7))
    changed = ids.clone()
    changed[:, 4:] = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :4], model(changed)[:, :4], atol=1e-6, rtol=0)


def test_explicit_positions():
    """pos=0..T-1 is the default; a shifted pos changes learned-position logits."""
    model = decoder("learned")
    ids = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos=torch.arange(5)), model(ids))
        assert not torch.allclose(model(ids, pos=torch.arange(3, 8)), model(ids))


def test_dropout_only_in_training():
    model = decoder(dropout=0.5)
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids))
        model.train()
        assert not torch.allclose(model(ids), model(ids))


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_last_only_is_the_last_position_of_the_full_logits(preset):
    model = build_model(get_preset(preset)).eval()
    ids = torch.randint(model.head.out_features, (2, 9))
    with torch.no_grad():
        full, last = model(ids), model(ids, last_only=True)  # (2, 9, V), (2, 1, V)
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-6)
