"""attnlab.checkpoint.open_checkpoint, the one loader: every kind of checkpoint opens as the model
that was saved (outputs compared with the in-memory original), and what save_pretrained and
save_checkpoint write, it reads. (Quantized checkpoints: tests/quantize/test_quantize_handler.py.)
"""

from dataclasses import replace

import pytest
import torch

from attnlab.checkpoint import (
    CheckpointDir,
    Loaded,
    open_checkpoint,
    save_checkpoint,
    save_pretrained,
)
from attnlab.configs import to_dict
from attnlab.interop.hf import save_hf
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig
from attnlab.models.encoder import EncoderForClassification
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer
from attnlab.training.config import RunConfig


def same_outputs(a: torch.nn.Module, b: torch.nn.Module, vocab_size: int) -> None:
    ids = torch.randint(vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)


def test_a_bert_classifier_saved_model_only_opens_as_a_classifier(tmp_path):
    """Issue 18: a classifier written by the model-only save was rejected by the training
    loader (missing head.*, unexpected classifier.*). Failed before the one loader."""
    cfg = get_preset("bert-tiny")
    model = build_model(cfg, n_labels=3).eval()
    save_pretrained(tmp_path / "clf", model, cfg)
    loaded = open_checkpoint(tmp_path / "clf")
    assert isinstance(loaded.model, EncoderForClassification)
    assert loaded.run["n_labels"] == 3 and loaded.tokenizer is None
    assert loaded.config == replace(cfg, head=HeadConfig("sequence", 3))  # the head is config
    same_outputs(loaded.model, model, cfg.vocab_size)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "t5-tiny", "bert-tiny"])
def test_a_model_only_checkpoint_round_trips(tmp_path, preset):
    cfg = get_preset(preset)
    model = build_model(cfg).eval()
    tokenizer = train_char_tokenizer(["to be or not to be"])
    path = save_pretrained(tmp_path / "m", model, cfg, tokenizer)
    loaded = open_checkpoint(path, "cpu")
    assert isinstance(loaded, Loaded) and loaded.path == path and loaded.config == cfg
    assert loaded.tokenizer.encode("not") == tokenizer.encode("not")
    assert not loaded.model.training
    if cfg.arch == "encoder_decoder":
        ids = torch.randint(cfg.vocab_size, (2, 7))
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(ids, ids), model(ids, ids), rtol=0, atol=0)
    else:
        same_outputs(loaded.model, model, cfg.vocab_size)
    if preset == "gpt2-tiny":  # the tie survives the load
        assert loaded.model.head.weight is loaded.model.embed.weight


def test_a_training_checkpoint_and_its_run_directory(tmp_path):
    """A run's out_dir and its checkpoints/ resolve to the checkpoint `latest` names."""
    cfg = replace(get_preset("llama-tiny"), n_layers=1)
    model = build_model(cfg).eval()
    run = RunConfig(cfg)
    ckpts = CheckpointDir(tmp_path / "run" / "checkpoints")
    ckpts.save(1, build_model(cfg), None, run, {"step": 1})
    ckpts.save(2, model, None, run, {"step": 2})
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        loaded = open_checkpoint(where)
        assert loaded.path == tmp_path / "run" / "checkpoints" / "step_000002"
        assert loaded.run == to_dict(run)
        same_outputs(loaded.model, model, cfg.vocab_size)


def test_a_run_directory_with_a_dangling_latest_opens_its_newest_complete_step(tmp_path):
    """As resume does (CheckpointDir.latest): `latest` naming nothing falls back to a step."""
    cfg = replace(get_preset("llama-tiny"), n_layers=1)
    model = build_model(cfg).eval()
    ckpts = CheckpointDir(tmp_path / "run" / "checkpoints")
    ckpts.save(2, model, None, RunConfig(cfg), {"step": 2})
    (ckpts.root / "latest").write_text("step_000009")  # a pointer to a checkpoint that is gone
    loaded = open_checkpoint(tmp_path / "run")
    assert loaded.path == ckpts.root / "step_000002"
    same_outputs(loaded.model, model, cfg.vocab_size)


def test_an_hf_directory_opens_through_the_converter(tmp_path):
    cfg = get_preset("gpt2-tiny")
    model = build_model(cfg).eval()
    save_hf(model, cfg, tmp_path / "hf")
    loaded = open_checkpoint(tmp_path / "hf")
    assert loaded.config == cfg and set(loaded.run) == {"model"}
    same_outputs(loaded.model, model, cfg.vocab_size)


def test_an_hf_classifier_keeps_its_labels(tmp_path):
    cfg = get_preset("bert-tiny")
    model = build_model(cfg, n_labels=4).eval()
    save_hf(model, cfg, tmp_path / "hf")
    loaded = open_checkpoint(tmp_path / "hf")
    assert isinstance(loaded.model, EncoderForClassification) and loaded.run["n_labels"] == 4
    same_outputs(loaded.model, model, cfg.vocab_size)


def test_what_save_checkpoint_writes_opens(tmp_path):
    cfg = get_preset("gpt2-tiny")
    model = build_model(cfg).eval()
    tokenizer = train_char_tokenizer(["abc"])
    save_checkpoint(tmp_path / "c", model, None, RunConfig(cfg), {"step": 0}, tokenizer=tokenizer)
    loaded = open_checkpoint(tmp_path / "c")
    assert loaded.tokenizer is not None and loaded.run["model"]["d_model"] == cfg.d_model
    same_outputs(loaded.model, model, cfg.vocab_size)


def test_bad_directories_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="'.*nowhere' is not a checkpoint .*config.json"):
        open_checkpoint(tmp_path / "nowhere")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'model' section"):
        open_checkpoint(tmp_path / "odd")
    (tmp_path / "odd" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json' is not valid JSON"):
        open_checkpoint(tmp_path / "odd")
    cfg = get_preset("gpt2-tiny")
    save_pretrained(tmp_path / "m", build_model(cfg), cfg)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        open_checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match="layout='interleaved' applies to HF"):
        open_checkpoint(tmp_path / "m", layout="interleaved")


@pytest.mark.hf
def test_a_transformers_classifier_through_both_saves_matches_transformers(tmp_path):
    """HF directory -> open -> save_pretrained -> open: logits equal transformers' own."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = T.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=64,
        num_labels=3,
    )
    hf = T.BertForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    first = open_checkpoint(tmp_path / "hf")
    save_pretrained(tmp_path / "ours", first.model, first.config)
    again = open_checkpoint(tmp_path / "ours")
    assert isinstance(again.model, EncoderForClassification) and again.run["n_labels"] == 3
    ids = torch.randint(100, (2, 9))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        torch.testing.assert_close(again.model(ids), expected, rtol=0, atol=1e-4)
