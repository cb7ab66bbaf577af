"""Whole directories: attnlab <-> HF conversion, format detection, tokenizers travelling along."""

import json

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.interop.convert import convert, detect_format
from attnlab.interop.hf import save_hf
from attnlab.models.build import build_model
from attnlab.models.presets import bert_tiny, llama_tiny
from attnlab.tokenizer import train_char_tokenizer
from tests.interop.helpers import padded_batch, same_state


@pytest.fixture
def attnlab_dir(tmp_path):
    model = build_model(llama_tiny()).eval()
    tok = train_char_tokenizer(["the quick brown fox"])
    return save_pretrained(tmp_path / "ours", model, llama_tiny(), tok), model


def test_attnlab_to_hf_to_attnlab(attnlab_dir, tmp_path):
    src, model = attnlab_dir
    convert("attnlab", src, "hf", tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    convert("hf", tmp_path / "hf", "attnlab", tmp_path / "back")
    back = open_checkpoint(tmp_path / "back")
    again, tok = back.model, back.tokenizer
    assert same_state(again.state_dict(), model.state_dict())
    assert tok.encode("fox") == train_char_tokenizer(["the quick brown fox"]).encode("fox")


def test_interleaved_layout_through_convert(attnlab_dir, tmp_path):
    src, model = attnlab_dir
    convert("attnlab", src, "hf", tmp_path / "hf")
    convert("hf", tmp_path / "hf", "attnlab", tmp_path / "inter", layout="interleaved")
    opened = open_checkpoint(tmp_path / "inter")
    inter, cfg = opened.model, opened.config
    assert cfg.rope.layout == "interleaved"
    ids, mask = padded_batch(vocab=256)
    with torch.no_grad():
        assert (inter(ids, mask) - model(ids, mask))[mask].abs().max() <= 1e-5
    convert("attnlab", tmp_path / "inter", "hf", tmp_path / "hf2")  # permuted back on export
    a, b = open_checkpoint(tmp_path / "hf").model, open_checkpoint(tmp_path / "hf2").model
    assert same_state(a.state_dict(), b.state_dict())


def test_classifier_keeps_its_labels(tmp_path):
    model = build_model(bert_tiny(), n_labels=5).eval()
    save_hf(model, bert_tiny(), tmp_path / "hf")
    convert("hf", tmp_path / "hf", "attnlab", tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["n_labels"] == 5
    again = open_checkpoint(tmp_path / "ours").model
    assert same_state(again.state_dict(), model.state_dict())


def test_bad_requests(attnlab_dir, tmp_path):
    src, _ = attnlab_dir
    with pytest.raises(ValueError, match="is an attnlab checkpoint, not hf"):
        convert("hf", src, "attnlab", tmp_path / "x")
    with pytest.raises(ValueError, match="'onnx' is not one of"):
        convert("attnlab", src, "onnx", tmp_path / "x")
    with pytest.raises(ValueError, match="output directory is the input"):
        convert("attnlab", src, "hf", src)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither an attnlab"):
        detect_format(tmp_path / "odd")


@pytest.mark.hf
def test_exported_directory_loads_in_transformers(attnlab_dir, tmp_path):
    T = pytest.importorskip("transformers")
    src, model = attnlab_dir
    convert("attnlab", src, "hf", tmp_path / "hf")
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = T.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("fox", add_special_tokens=False).input_ids == train_char_tokenizer(
        ["the quick brown fox"]
    ).encode("fox")
    ids, mask = padded_batch(vocab=256)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask.long()).logits
        assert (out - model(ids, mask))[mask].abs().max() <= 1e-4
