"""`attnlab check --model A --reference B --input TEXT_OR_IDS`: tables, exit codes, errors."""

from dataclasses import replace

import pytest
import torch

from attnlab.checkpoint import save_pretrained
from attnlab.cli.__main__ import main
from attnlab.interop.hf import save_hf
from attnlab.models.build import build_model
from attnlab.models.presets import llama_tiny
from attnlab.tokenizer import train_char_tokenizer


@pytest.fixture
def dirs(tmp_path):
    torch.manual_seed(0)
    model = build_model(llama_tiny()).eval()
    tok = train_char_tokenizer(["the cat sat on the mat"])
    save_pretrained(tmp_path / "ours", model, llama_tiny(), tok)
    save_pretrained(tmp_path / "buggy", model, replace(llama_tiny(), norm_eps=0.5), tok)  # planted
    return tmp_path


def check(model, reference, *inputs: str) -> int:
    """`attnlab check --model MODEL --reference REFERENCE --input I ...`: the exit code."""
    return main(
        ["check", "--model", str(model), "--reference", str(reference)]
        + [arg for text in inputs for arg in ("--input", text)]
    )


def test_matching_models_exit_0(dirs, capsys):
    assert check(dirs / "ours", dirs / "ours", "the cat", "5 6 7 8 9 10") == 0
    out = capsys.readouterr().out
    assert "every point is within tolerance" in out and "block.1" in out


def test_a_divergence_exits_1_and_names_the_cause(dirs, capsys):
    assert check(dirs / "buggy", dirs / "ours", "3 4 5 6 7 8") == 1
    out = capsys.readouterr().out
    assert "first divergence: block.0" in out and "likely cause: norm eps" in out


def test_text_without_a_tokenizer_is_an_error(dirs, capsys):
    (dirs / "ours" / "tokenizer.json").unlink()
    assert check(dirs / "ours", dirs / "ours", "some words") == 2
    assert "token ids" in capsys.readouterr().err


@pytest.mark.hf
def test_hf_directory_against_transformers(tmp_path, capsys):
    pytest.importorskip("transformers")
    model = build_model(llama_tiny()).eval()
    save_hf(model, llama_tiny(), tmp_path / "hf")
    assert check(tmp_path / "hf", tmp_path / "hf", "1 2 3 4 5 6 7") == 0
    out = capsys.readouterr().out
    assert "B: transformers LlamaForCausalLM" in out and "every point is within tolerance" in out
