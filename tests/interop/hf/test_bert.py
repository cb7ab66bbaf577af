"""BERT: masked-LM logits and hidden states, sequence classification, export and round trips."""

import pytest
import torch

from attnlab.interop.hf import bert, load_hf, save_hf
from attnlab.models.encoder import EncoderForClassification, EncoderForMLM
from tests.interop.helpers import ATOL, VOCAB, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def tiny(cls, **extra):
    torch.manual_seed(0)
    return cls(T.BertConfig(**CONFIG | extra)).eval()


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    hf = tiny(T.BertForMaskedLM)
    path = tmp_path_factory.mktemp("bert-mlm")
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return hf, ours, cfg


def test_mlm_logits_and_hidden_states(mlm):
    hf, ours, cfg = mlm
    assert isinstance(ours, EncoderForMLM) and ours.head.decoder.weight is ours.encoder.embed.weight
    ids, mask = padded_batch()
    types = (torch.arange(12) >= 6).long().expand(3, -1)  # two segments
    with torch.no_grad():
        out = hf(
            input_ids=ids,
            attention_mask=mask.long(),
            token_type_ids=types,
            output_hidden_states=True,
        )
        hidden = ours.encoder(ids, mask, types)
        assert max_diff(hidden, out.hidden_states[-1], mask) <= ATOL
        assert max_diff(ours.head(hidden), out.logits, mask) <= ATOL


def test_mlm_export_and_round_trip(mlm, tmp_path):
    hf, ours, cfg = mlm
    save_hf(ours, cfg, tmp_path / "hf")
    back = T.BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert same_state(back.state_dict(), hf.state_dict())
    again, cfg2 = bert.load_hf(tmp_path / "hf")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


def test_sequence_classification(tmp_path):
    hf = tiny(T.BertForSequenceClassification, num_labels=3)
    hf.save_pretrained(tmp_path / "hf")
    ours, cfg = load_hf(tmp_path / "hf")
    assert isinstance(ours, EncoderForClassification) and ours.classifier.out_features == 3
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        assert (
            max_diff(ours(ids, mask), hf(input_ids=ids, attention_mask=mask.long()).logits) <= ATOL
        )
    save_hf(ours, cfg, tmp_path / "back")
    back = T.BertForSequenceClassification.from_pretrained(tmp_path / "back")
    assert same_state(back.state_dict(), hf.state_dict())
