"""`attnlab lab patch`: the command writes the patching maps, the attribution and the JSON."""

import json

import pytest

from attnlab.cli.__main__ import main


@pytest.mark.slow
def test_cli_lab_patch_end_to_end(tmp_path, capsys):
    text = "tests/data/tinyshakespeare_head.txt"
    run = tmp_path / "run"
    train = ["train", "--preset", "llama-tiny", "--data.source", text, "--data.cache_dir"]
    train += [str(tmp_path / "cache"), "--train.steps", "2", "--train.batch_size", "2"]
    train += ["--train.context", "32", "--train.progress", "false", "--train.out_dir", str(run)]
    train += ["--train.device", "cpu", "--train.sample_tokens", "0", "--train.eval_batches", "1"]
    train += ["--data.tokenizer", "char"]
    assert main(train) == 0
    capsys.readouterr()
    out = tmp_path / "patch"
    cmd = ["lab", "patch", "--ckpt", str(run), "--clean", "First Citizen", "--corrupt"]
    cmd += ["First Sitizen", "--answer", ":", "--wrong", ",", "--out", str(out)]
    assert main(cmd) == 0
    printed = capsys.readouterr().out
    assert "largest direct logit attribution" in printed
    data = json.loads((out / "patching.json").read_text())
    assert len(data["tokens"]) == 13
    assert set(data["patching"]) == {"resid_pre", "attn_out", "mlp_out", "head"}
    assert len(data["patching"]["resid_pre"]) == 2 and len(data["patching"]["resid_pre"][0]) == 13
    assert data["patching"]["resid_pre"][0][6] == pytest.approx(1.0, abs=1e-4)  # the changed letter
    assert data["dla"]["total"] == pytest.approx(data["clean"], abs=1e-4)
    for name in ("patching.png", "attribution.png"):
        assert (out / name).stat().st_size > 1000
    bad = ["lab", "patch", "--ckpt", str(run), "--clean", "First", "--corrupt", "Firs"]
    assert main(bad + ["--answer", ":", "--out", str(out)]) == 2
    assert "same length" in capsys.readouterr().err
    assert main(cmd[:-4] + ["--answer", "ab", "--out", str(out)]) == 2
    assert "single-token" in capsys.readouterr().err
