"""Reading and writing HF directories without transformers: bad inputs name what is wrong;
shards, the dispatcher, configs a family cannot hold, tokenizers."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.interop.hf import gpt2, load_hf, load_tokenizer, save_hf, save_tokenizer
from attnlab.interop.hf.common import read_state_dict
from attnlab.models.build import build_model
from attnlab.models.presets import bert_tiny, get_preset, gpt2_tiny, llama_tiny, t5_tiny
from attnlab.tokenizer import train_char_tokenizer
from tests.interop.helpers import padded_batch, same_state


@pytest.fixture
def gpt2_dir(tmp_path):
    """An HF GPT-2 directory, written by our exporter."""
    model = build_model(gpt2_tiny()).eval()
    save_hf(model, gpt2_tiny(), tmp_path / "gpt2")
    return tmp_path / "gpt2", model


def rewrite(path, drop=(), add=None, config=None):
    state = load_file(str(path / "model.safetensors"))
    state = {k: v for k, v in state.items() if k not in drop} | (add or {})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text()) | config
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("preset", [gpt2_tiny, llama_tiny, bert_tiny, t5_tiny])
def test_round_trip_without_transformers(preset, tmp_path):
    model = build_model(preset()).eval()
    save_hf(model, preset(), tmp_path)
    again, cfg = load_hf(tmp_path)
    assert same_state(again.state_dict(), model.state_dict())


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    with pytest.raises(ValueError, match="FalconForCausalLM") as e:
        load_hf(tmp_path)
    assert "GPT2LMHeadModel" in str(e.value) and "T5ForConditionalGeneration" in str(e.value)


def test_pickle_only_directory_is_refused(gpt2_dir):
    path, _ = gpt2_dir
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors only"):
        load_hf(path)


def test_missing_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model.safetensors"):
        read_state_dict(tmp_path)


def test_missing_and_unexpected_keys_are_all_listed(gpt2_dir):
    path, _ = gpt2_dir
    rewrite(
        path,
        drop=["transformer.h.1.ln_2.weight", "transformer.wpe.weight"],
        add={"transformer.h.0.attn.rotary.weight": torch.zeros(2)},
    )
    with pytest.raises(ValueError) as e:
        load_hf(path)
    msg = str(e.value)
    for key in (
        "transformer.h.1.ln_2.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.rotary.weight",
    ):
        assert key in msg


def test_shape_mismatch_names_the_key_and_both_shapes(gpt2_dir):
    path, _ = gpt2_dir
    rewrite(path, config={"n_inner": 200})
    with pytest.raises(
        ValueError,
        match=r"transformer.h.0.mlp.c_fc.weight: checkpoint "
        r"\(64, 256\), model \(64, 200\)",
    ):
        load_hf(path)


def test_old_buffers_are_ignored(gpt2_dir):
    path, model = gpt2_dir
    rewrite(path, add={"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4)})
    again, _ = load_hf(path)
    assert same_state(again.state_dict(), model.state_dict())


def test_sharded_checkpoint(gpt2_dir):
    path, model = gpt2_dir
    state = load_file(str(path / "model.safetensors"))
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    again, _ = load_hf(path)
    assert same_state(again.state_dict(), model.state_dict())
    ids, mask = padded_batch(vocab=256)
    with torch.no_grad():
        assert torch.equal(again(ids, mask), model(ids, mask))


def test_configs_a_family_cannot_hold_are_listed():
    cfg = get_preset("transformer-tiny")
    with pytest.raises(ValueError, match="position='sinusoidal'"):
        save_hf(build_model(cfg), cfg, "/nonexistent")
    llama = llama_tiny()
    odd = replace(llama, scale_embeddings=True, norm="layernorm")
    with pytest.raises(ValueError, match="norm='layernorm'.*scale_embeddings=True"):
        save_hf(build_model(odd), odd, "/nonexistent")
    with pytest.raises(ValueError, match="RoPE"):
        gpt2.load_hf("/nonexistent", layout="interleaved")


def test_tokenizer_round_trip(tmp_path):
    tok = train_char_tokenizer(["hello world"])
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode("hello") == tok.encode("hello")
    assert again.token_id("<eos>") == tok.token_id("<eos>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<eos>" and config["pad_token"] == "<pad>"
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nothing-here")
