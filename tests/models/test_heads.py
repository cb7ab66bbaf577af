"""Task heads (models/heads.py): the head in the config, the last-token rule, padding
invariance, checkpoint round trips with the label names, and building on a pre-trained body.
(Logits against transformers: tests/interop/hf/test_heads.py.)"""

import json
from dataclasses import replace

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.configs import from_dict, to_dict
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.encoder import EncoderForClassification
from attnlab.models.heads import (
    DecoderForSequenceClassification,
    EncoderForMeanPooledClassification,
    EncoderForTokenClassification,
    copy_body,
    head_modules,
    last_token_index,
)
from attnlab.models.presets import get_preset

LABELS = ("B-NAME", "I-NAME", "O")
KINDS = {  # name: (preset, head, our class)
    "bert-sequence": ("bert-tiny", HeadConfig("sequence", 3, LABELS), EncoderForClassification),
    "bert-token": ("bert-tiny", HeadConfig("token", 3, LABELS), EncoderForTokenClassification),
    "bert-mean": (
        "bert-tiny",
        HeadConfig("sequence", 3, LABELS, pooling="mean"),
        EncoderForMeanPooledClassification,
    ),
    "gpt2-sequence": (
        "gpt2-tiny",
        HeadConfig("sequence", 3, LABELS, pad_token_id=0),
        DecoderForSequenceClassification,
    ),
    "llama-sequence": (
        "llama-tiny",
        HeadConfig("sequence", 3, LABELS),
        DecoderForSequenceClassification,
    ),
}


def head_cfg(name: str) -> ModelConfig:
    preset, head, _ = KINDS[name]
    return replace(get_preset(preset), head=head)


def test_last_token_index_follows_the_mask_then_the_pad_id():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 0, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    assert last_token_index(ids, mask).tolist() == [2, 4, 3]  # right, left, a real id 0 inside
    assert last_token_index(ids, pad_token_id=0).tolist() == [2, 4, 2]  # HF's ids != pad rule
    assert last_token_index(ids).tolist() == [4, 4, 4]


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_decoder_classifier_reads_the_last_real_token(preset):
    """A right-padded row gives the logits of the row alone, whatever the padding holds."""
    cfg = replace(get_preset(preset), head=HeadConfig("sequence", 4))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        batch = model(ids, mask)  # (2, 4)
        alone = model(ids[1:, :5])  # no padding: the last position
        junk = model(ids.masked_fill(~mask, 7), mask)
    assert batch.shape == (2, 4)
    torch.testing.assert_close(batch[1:], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch, junk, rtol=0, atol=1e-6)


def test_token_classifier_gives_one_prediction_per_token():
    model = build_model(head_cfg("bert-token")).eval()
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        logits = model(ids)
        hidden = model.encoder(ids)
    assert logits.shape == (2, 7, 3)
    torch.testing.assert_close(logits, hidden @ model.classifier.weight.T + model.classifier.bias)


def test_mean_pooled_classifier_pools_the_real_tokens_only():
    """pooling "mean": tanh(W_p mean of the real tokens' hidden states + b_p), then the
    classifier, by hand from the encoder's output; a padded row gives the row alone's logits
    whatever its padding holds."""
    torch.manual_seed(0)
    model = build_model(head_cfg("bert-mean")).eval()
    ids = torch.randint(3, 100, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 4:] = False
    with torch.no_grad():
        logits = model(ids, mask)
        h = model.encoder(ids, mask)  # (2, 9, C)
        mean = torch.stack([h[0].mean(0), h[1, :4].mean(0)])  # (2, C)
        by_hand = model.classifier(torch.tanh(model.pooler(mean)))
        alone = model(ids[1:, :4])
        junk = model(ids.masked_fill(~mask, 7), mask)
    torch.testing.assert_close(logits, by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits[1:], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, junk, rtol=0, atol=1e-6)
    cls = EncoderForClassification(model.encoder, model.pooler.in_features, 3)
    cls.load_state_dict(model.state_dict())
    with torch.no_grad():  # the same weights pooled at [CLS] give other logits
        assert (cls(ids, mask) - logits).abs().max() > 1e-4


def test_a_mean_pooled_head_has_no_hf_class():
    from attnlab.interop.hf import save_hf

    cfg = replace(head_cfg("bert-mean"), position="learned")
    with pytest.raises(ValueError, match="head.pooling='mean' .*BertForSequenceClassification"):
        save_hf(build_model(cfg), cfg, "unused")


@pytest.mark.parametrize("name", KINDS)
def test_head_and_labels_survive_a_checkpoint(name, tmp_path):
    cfg = head_cfg(name)
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg  # labels: a JSON list back to a tuple
    model = build_model(cfg).eval()
    assert type(model) is KINDS[name][2]
    save_pretrained(tmp_path / "m", model, cfg)
    loaded = open_checkpoint(tmp_path / "m")
    assert loaded.config == cfg and loaded.config.head.id2label == dict(enumerate(LABELS))
    ids = torch.randint(3, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), model(ids), rtol=0, atol=0)


def test_a_legacy_classifier_checkpoint_still_opens(tmp_path):
    """Before heads were in the config, a classifier's config.json had only "n_labels"."""
    cfg = get_preset("bert-tiny")
    model = build_model(cfg, n_labels=2).eval()
    save_pretrained(tmp_path / "m", model, cfg)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model": to_dict(cfg), "n_labels": 2}))
    loaded = open_checkpoint(tmp_path / "m")
    assert isinstance(loaded.model, EncoderForClassification)
    assert loaded.config.head == HeadConfig("sequence", 2)


@pytest.mark.parametrize("name", KINDS)
def test_copy_body_keeps_every_pretrained_weight(name):
    cfg = head_cfg(name)
    torch.manual_seed(0)
    base = build_model(replace(cfg, head=None))
    model = copy_body(build_model(cfg), base)
    fresh = tuple(f"{m}." for m in head_modules(model))
    given = base.state_dict()
    body = [k for k in model.state_dict() if not k.startswith(fresh)]
    assert body and all(torch.equal(model.state_dict()[k], given[k]) for k in body)
    assert model.training


def test_copy_body_refuses_a_base_of_another_family():
    with pytest.raises(
        ValueError, match="DecoderLM is not a base for EncoderForTokenClassification"
    ):
        copy_body(build_model(head_cfg("bert-token")), build_model(get_preset("gpt2-tiny")))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(arch="encoder_decoder"), "a 'sequence' head needs arch in"),
        (dict(head=HeadConfig("token", 2)), "a 'token' head needs arch in \\['encoder'\\]"),
        (dict(head=HeadConfig("sequence", 2, pad_token_id=10**6)), "head.pad_token_id=1000000"),
        (dict(head=HeadConfig("sequence", 2, pooling="mean")), "pooling='mean' is for an encoder"),
    ],
)
def test_bad_heads_are_named(change, message):
    cfg = replace(get_preset("gpt2-tiny"), head=HeadConfig("sequence", 2))
    with pytest.raises(ValueError, match=message):
        replace(cfg, **change)


def test_bad_labels_are_named():
    with pytest.raises(ValueError, match=r"names 2 labels \['a', 'b'\], but head.num_labels=3"):
        HeadConfig("sequence", 3, ("a", "b"))
    with pytest.raises(ValueError, match="repeated names"):
        HeadConfig("sequence", 2, ("a", "a"))
    with pytest.raises(ValueError, match="num_labels must be >= 1, got 0"):
        HeadConfig("token", 0)
    with pytest.raises(ValueError, match="pooling='mean' is for a sequence head"):
        HeadConfig("token", 2, pooling="mean")
