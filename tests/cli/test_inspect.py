"""`attnlab inspect`: presets, config.json paths, and errors (exit code 2, message on stderr)."""

import json

import pytest

from attnlab.cli.__main__ import main
from attnlab.configs import to_dict
from attnlab.models.presets import get_preset


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_inspect_gpt2(capsys):
    assert main(["inspect", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out
    assert out.startswith("model")


def test_inspect_several_and_context(capsys):
    assert main(["inspect", "gpt2-tiny", "llama-tiny", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-tiny" in out and "llama-tiny" in out
    assert "FLOPs/token @ 16" in out


def test_unknown_preset(capsys):
    assert main(["inspect", "gpt5-turbo"]) == 2
    err = capsys.readouterr().err
    assert "gpt5-turbo" in err and "gpt2" in err  # the name, and the known presets


def test_missing_config_file(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    assert main(["inspect", str(missing)]) == 2
    assert "nope.json" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_config_json_path(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_dict(get_preset("gpt2"))))
    assert main(["inspect", str(path)]) == 0
    assert "124,439,808" in capsys.readouterr().out


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_checkpoint_style_config(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": to_dict(get_preset("llama2-7b")), "train": {}}))
    assert main(["inspect", str(path)]) == 0
    assert "6,738,415,616" in capsys.readouterr().out


def test_invalid_config_file(capsys, tmp_path):
    data = to_dict(get_preset("gpt2-tiny"))
    data["n_layer"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["inspect", str(path)]) == 2
    assert "n_layer" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_config_file_without_suffix(capsys, tmp_path):
    path = tmp_path / "gpt2_config"
    path.write_text(json.dumps(to_dict(get_preset("gpt2"))))
    assert main(["inspect", str(path)]) == 0
    assert "124,439,808" in capsys.readouterr().out


def test_config_file_not_an_object(capsys, tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert main(["inspect", str(path)]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_config_file_missing_fields(capsys, tmp_path):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"d_model": 64}))
    assert main(["inspect", str(path)]) == 2
    assert "arch" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_context_past_the_positions_is_warned_about(capsys):
    assert main(["inspect", "--context", "4096", "gpt2"]) == 0
    err = capsys.readouterr().err
    assert "warning: gpt2 has 1,024 positions and --context is 4,096" in err
    assert main(["inspect", "--context", "1024", "gpt2"]) == 0
    assert "warning" not in capsys.readouterr().err
