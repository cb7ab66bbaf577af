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


@pytest.mark.hf
def test_gguf_to_hf_generation_stops_where_attnlabs_does(tmp_path):
    """An HF directory from a GGUF names its special ids, chat template and a generation config
    (eos from tokenizer.ggml.eos_token_id, sampling from general.sampling.*): transformers'
    greedy `generate` on it stops at <|im_end|> with attnlab's tokens. The tiny model's head
    makes <|im_end|> win where its 4th greedy token would (twice that token's row)."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from attnlab.inference.config import GenerationConfig
    from attnlab.inference.generate import generate
    from attnlab.inference.sampling import SamplingConfig
    from tests.interop.gguf.files import byte_level_tokenizer, tiny_hf_llama, write_gguf

    tok, model = byte_level_tokenizer(), tiny_hf_llama(320, tie=False)
    eos, prompt = tok.token_to_id("<|im_end|>"), tok.encode("The quick brown fox").ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
        model.lm_head.weight[eos] = 2 * model.lm_head.weight[free[0, -1]]
    sampling = {"general.sampling.temp": 0.5, "general.sampling.top_k": 20}
    src = write_gguf(tmp_path / "src.gguf", model, tok, sampling=sampling)
    convert("gguf", src, "hf", tmp_path / "hf")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    pad, bos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>")
    for written in (config, generation):
        assert (written["bos_token_id"], written["eos_token_id"]) == (bos, eos)
        assert written["pad_token_id"] == pad
    assert [generation[k] for k in ("do_sample", "temperature", "top_k")] == [True, 0.5, 20]
    hf_tok = T.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (bos, eos, pad)
    loaded = open_checkpoint(src)
    assert hf_tok.chat_template == loaded.tokenizer.chat_template

    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    greedy = GenerationConfig(16, SamplingConfig(temperature=0.0), stop_tokens=(eos,))
    with torch.no_grad():
        ours = generate(loaded.model, [prompt], greedy)[0]
        theirs = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, len(prompt) :]
    assert ours[-1] == eos and len(ours) < 16
    assert theirs.tolist() == ours
