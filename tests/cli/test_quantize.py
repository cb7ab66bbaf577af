"""`attnlab quantize`: a tiny float checkpoint in, a quantized checkpoint out, errors reported."""

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.cli.__main__ import main
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import Int4Linear, Int8Linear, read_scheme
from attnlab.tokenizer import train_char_tokenizer
from attnlab.training.config import RunConfig


@pytest.fixture
def ckpt(tmp_path):
    model = build_model(get_preset("llama-tiny"))
    tokenizer = train_char_tokenizer(["to be or not to be"])
    return save_checkpoint(
        tmp_path / "float",
        model,
        None,
        RunConfig(get_preset("llama-tiny")),
        {"step": 0},
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize("scheme, group, cls", [("int8", 32, Int8Linear), ("int4", 64, Int4Linear)])
def test_quantize_smoke(capsys, tmp_path, ckpt, scheme, group, cls):
    out = tmp_path / "q"
    argv = [
        "quantize",
        "--ckpt",
        str(ckpt),
        "--scheme",
        scheme,
        "--group-size",
        str(group),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "logit error vs fp32" in printed and "max " in printed and "mean " in printed
    assert "model.safetensors:" in printed and "MB" in printed and "smaller" in printed
    assert "quantized 15 Linear layers" in printed  # 2 blocks x 7, and the head
    assert read_scheme(out / "model.safetensors").name == scheme
    loaded = open_checkpoint(out, scheme=scheme)
    model, tokenizer = loaded.model, loaded.tokenizer
    assert tokenizer.decode(tokenizer.encode("not to be")) == "not to be"  # copied along
    assert isinstance(model.blocks[0].ffn.up_proj, cls) and isinstance(model.head, cls)
    assert model(torch.randint(256, (1, 8))).shape == (1, 8, 256)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_generate_and_quantize_again_from_a_quantized_checkpoint(capsys, tmp_path, ckpt):
    out = tmp_path / "q"
    assert main(["quantize", "--ckpt", str(ckpt), "--scheme", "int8", "--out", str(out)]) == 0
    capsys.readouterr()
    argv = ["generate", "--ckpt", str(out), "--prompt", "to be", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    loaded = open_checkpoint(out, scheme="int8")
    model, tokenizer = loaded.model, loaded.tokenizer
    greedy, eos = SamplingConfig(temperature=0.0), tokenizer.token_id("<eos>")
    new = generate(
        model, [tokenizer.encode("to be")], GenerationConfig(4, greedy, stop_tokens=[eos])
    )[0]
    assert printed == "to be" + tokenizer.decode(new) + "\n"
    again = ["quantize", "--ckpt", str(out), "--scheme", "int4", "--out", str(tmp_path / "q4")]
    assert main(again) == 2
    assert "already quantized (int8)" in capsys.readouterr().err


def test_float_heads_flag_keeps_the_head_float(capsys, tmp_path, ckpt):
    out = tmp_path / "q"
    argv = ["quantize", "--ckpt", str(ckpt), "--scheme", "int8", "--out", str(out)]
    assert main([*argv, "--float-heads"]) == 0
    assert "quantized 14 Linear layers" in capsys.readouterr().out  # 2 blocks x 7
    model = open_checkpoint(out, scheme="int8").model
    assert type(model.head) is torch.nn.Linear


def test_bad_group_size_is_an_error(capsys, tmp_path, ckpt):
    argv = [
        "quantize",
        "--ckpt",
        str(ckpt),
        "--scheme",
        "int4",
        "--group-size",
        "48",
        "--out",
        str(tmp_path / "q"),
    ]
    assert main(argv) == 2
    assert "group_size=48" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_out_must_differ_and_ckpt_must_exist(capsys, tmp_path, ckpt):
    assert main(["quantize", "--ckpt", str(ckpt), "--scheme", "int8", "--out", str(ckpt)]) == 2
    assert "--out must differ" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["quantize", "--ckpt", str(missing), "--scheme", "int8", "--out", "x"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_unknown_scheme_rejected_by_parser(capsys, ckpt):
    with pytest.raises(SystemExit):
        main(["quantize", "--ckpt", str(ckpt), "--scheme", "int3", "--out", "x"])
    assert "int3" in capsys.readouterr().err


def test_a_full_disk_names_quantizes_own_output_flag(capsys, tmp_path, ckpt, monkeypatch):
    """The hint of a full disk names --out, the flag quantize has (not --train.out_dir)."""
    import errno
    import os

    import attnlab.checkpoint

    def full_disk(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(attnlab.checkpoint, "_write_file", full_disk)
    out = tmp_path / "q"
    assert main(["quantize", "--ckpt", str(ckpt), "--scheme", "int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "No space left on device" in err and "(e.g. --out)" in err, err
    assert "--train.out_dir" not in err, err
    assert not out.exists() and not list(tmp_path.glob("q.tmp"))
