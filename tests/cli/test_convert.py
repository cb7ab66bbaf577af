"""`attnlab convert --from FORMAT DIR --to FORMAT OUT`: both directions, and errors (exit 2)."""

import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.__main__ import main
from attnlab.interop.hf import save_hf
from attnlab.models.build import build_model
from attnlab.models.presets import gpt2_tiny
from tests.viz.checkpoints import make_checkpoint


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_hf_to_attnlab_and_back(tmp_path, capsys):
    model = build_model(gpt2_tiny()).eval()
    save_hf(model, gpt2_tiny(), tmp_path / "hf")
    assert (
        main(
            [
                "convert",
                "--from",
                "hf",
                str(tmp_path / "hf"),
                "--to",
                "attnlab",
                str(tmp_path / "ours"),
            ]
        )
        == 0
    )
    assert "wrote attnlab checkpoint" in capsys.readouterr().out
    assert (
        main(
            [
                "convert",
                "--from",
                "attnlab",
                str(tmp_path / "ours"),
                "--to",
                "hf",
                str(tmp_path / "hf2"),
            ]
        )
        == 0
    )
    loaded = open_checkpoint(tmp_path / "hf2")
    again, cfg = loaded.model, loaded.config
    assert cfg == gpt2_tiny()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_errors_exit_2_with_the_reason(tmp_path, capsys):
    assert (
        main(
            [
                "convert",
                "--from",
                "hf",
                str(tmp_path / "missing"),
                "--to",
                "attnlab",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "missing" in capsys.readouterr().err
    model = build_model(gpt2_tiny())
    save_hf(model, gpt2_tiny(), tmp_path / "hf")
    assert (
        main(
            [
                "convert",
                "--from",
                "attnlab",
                str(tmp_path / "hf"),
                "--to",
                "hf",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "is an hf checkpoint, not attnlab" in capsys.readouterr().err


def test_a_run_directory_converts_its_latest_checkpoint(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "run" / "checkpoints" / "step_000003", "gpt2-tiny")
    (ckpt.parent / "latest").write_text(ckpt.name)
    argv = [
        "convert",
        "--from",
        "attnlab",
        str(tmp_path / "run"),
        "--to",
        "hf",
        str(tmp_path / "hf"),
    ]
    assert main(argv) == 0
    a, b = open_checkpoint(ckpt).model, open_checkpoint(tmp_path / "hf").model
    assert all(torch.equal(b.state_dict()[k], v) for k, v in a.state_dict().items())


def test_a_full_disk_while_writing_hf_names_the_write_and_leaves_nothing(
    tmp_path, capsys, monkeypatch
):
    """safetensors reports a full disk as a SafetensorError after a partial file (issue 42):
    the one line names the file being written (not 'cannot read'), and no partial OUT stays."""
    from safetensors import SafetensorError

    import attnlab.interop.hf.common as common
    from attnlab.checkpoint import save_checkpoint
    from attnlab.tokenizer import train_char_tokenizer
    from attnlab.training.config import RunConfig

    cfg = gpt2_tiny()
    src = save_checkpoint(
        tmp_path / "run", build_model(cfg), None, RunConfig(cfg), {"step": 0},
        tokenizer=train_char_tokenizer(["to be or not to be"]),
    )  # fmt: skip

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")  # what got onto the disk before it filled up
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(common, "save_file", full_disk)
    out = tmp_path / "exported"
    assert main(["convert", "--from", "attnlab", str(src), "--to", "hf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"No space left on device writing model.safetensors in {out}" in err, err
    assert "cannot read" not in err and "--train.out_dir" not in err, err
    assert "another --to directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no OUT, no OUT.tmp
