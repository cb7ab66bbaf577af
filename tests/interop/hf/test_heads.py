"""Task heads against transformers: BertForSequenceClassification, BertForTokenClassification,
GPT2ForSequenceClassification and LlamaForSequenceClassification load with equal logits on a
padded batch, export to a directory transformers loads with equal logits, and keep their labels.
"""

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.interop.hf import load_hf, save_hf
from attnlab.models.build import build_model
from attnlab.models.encoder import EncoderForClassification
from attnlab.models.heads import DecoderForSequenceClassification, EncoderForTokenClassification
from tests.interop.helpers import TINY_LLAMA, VOCAB, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

TOL = 1e-5
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
BERT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    initializer_range=0.2,  # wide weights: logits far from zero, so a wrong pooling shows
)
GPT2 = dict(
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=VOCAB,
    n_positions=64,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
# name: (transformers class, its config class, config fields, our class, logits per token)
CASES = {
    "bert-sequence": (
        "BertForSequenceClassification",
        "BertConfig",
        BERT,
        EncoderForClassification,
        False,
    ),
    "bert-token": (
        "BertForTokenClassification",
        "BertConfig",
        BERT,
        EncoderForTokenClassification,
        True,
    ),
    "gpt2-sequence": (
        "GPT2ForSequenceClassification",
        "GPT2Config",
        GPT2,
        DecoderForSequenceClassification,
        False,
    ),
    "llama-sequence": (
        "LlamaForSequenceClassification",
        "LlamaConfig",
        TINY_LLAMA,
        DecoderForSequenceClassification,
        False,
    ),
}


def hf_model(name: str, seed: int = 0):
    cls, config_cls, fields, _, _ = CASES[name]
    torch.manual_seed(seed)
    label2id = {v: k for k, v in LABELS.items()}
    config = getattr(T, config_cls)(**fields, id2label=LABELS, label2id=label2id, pad_token_id=0)
    return getattr(T, cls)(config).eval()


def both_logits(name, hf, ours, seed=1):
    """(ours, transformers') logits on a right-padded batch (pad id 0, never a real token)."""
    ids, mask = padded_batch(seed=seed)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask.long()).logits
        mine = ours(ids, mask)
    return mine, theirs, mask if CASES[name][4] else None


@pytest.mark.parametrize("name", CASES)
def test_import_gives_equal_logits_and_labels(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    ours, cfg = load_hf(tmp_path / "hf")
    assert type(ours) is CASES[name][3]
    assert cfg.head.labels == ("negative", "neutral", "positive") and cfg.head.num_labels == 3
    mine, theirs, mask = both_logits(name, hf, ours)
    assert mine.shape == theirs.shape
    assert max_diff(mine, theirs, mask) <= TOL


@pytest.mark.parametrize("name", CASES)
def test_export_loads_in_transformers_with_equal_logits(name, tmp_path):
    hf_model(name).save_pretrained(tmp_path / "hf")
    _, cfg = load_hf(tmp_path / "hf")  # the config only: the weights are ours, freshly drawn
    torch.manual_seed(7)
    ours = build_model(cfg).eval()
    save_hf(ours, cfg, tmp_path / "out")
    back = getattr(T, CASES[name][0]).from_pretrained(tmp_path / "out").eval()
    assert back.config.id2label == LABELS and back.config.num_labels == 3
    mine, theirs, mask = both_logits(name, back, ours, seed=2)
    assert max_diff(mine, theirs, mask) <= TOL
    again, cfg2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


@pytest.mark.parametrize("name", ["gpt2-sequence", "llama-sequence"])
def test_decoder_without_a_mask_pools_by_the_pad_token_as_transformers(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    ours, cfg = load_hf(tmp_path / "hf")
    assert cfg.head.pad_token_id == 0
    ids, _ = padded_batch(seed=3)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(input_ids=ids).logits) <= TOL


def test_hf_classifier_opens_as_one_checkpoint_and_converts_back(tmp_path):
    hf = hf_model("bert-token")
    hf.save_pretrained(tmp_path / "hf")
    loaded = open_checkpoint(tmp_path / "hf")
    assert loaded.config.head.task == "token" and loaded.run["n_labels"] == 3
    save_pretrained(tmp_path / "ours", loaded.model, loaded.config)
    again = open_checkpoint(tmp_path / "ours")
    assert again.config == loaded.config
    save_hf(again.model, again.config, tmp_path / "hf2")
    back = T.BertForTokenClassification.from_pretrained(tmp_path / "hf2")
    assert back.config.id2label == LABELS
    assert same_state(back.state_dict(), hf.state_dict())
