"""Smoke test of `attnlab embodied`: train a scene model for 2 steps, then answer a new scene."""

import pytest
import torch

from attnlab.cli.__main__ import main
from tests.viz.checkpoints import make_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_train_then_answer_a_scene(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `generate --scene` draws into ./embodied_demo
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--preset",
            "vla-tiny",
            "--data.task",
            "vla",
            "--data.synthetic_n_val",
            "4",
            "--model.d_model",
            "32",
            "--model.d_ff",
            "64",
            "--train.steps",
            "2",
            "--train.batch_size",
            "4",
            "--train.warmup",
            "1",
            "--train.device",
            "cpu",
            "--train.progress",
            "false",
            "--train.out_dir",
            str(out),
        ]
    )
    assert code == 0
    capsys.readouterr()
    pictures = tmp_path / "demo"
    code = main(["embodied", "--ckpt", str(out), "--seed", "3", "--out", str(pictures)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "question  move to the " in printed and "expected  " in printed
    assert (pictures / "scene.png").is_file() and (pictures / "attention.png").is_file()

    # `attnlab generate --scene` answers the same scene the same way; a text prompt is refused.
    code = main(["generate", "--ckpt", str(out), "--scene", "3", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out.splitlines()[1:4] == printed.splitlines()[1:4]
    assert main(["generate", "--ckpt", str(out), "--prompt", "move to the cup"]) == 2
    assert f"`attnlab generate --ckpt {out} --scene S`" in capsys.readouterr().err


def test_missing_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["embodied", "--ckpt", str(tmp_path / "nothing"), "--seed", "1"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_a_classifier_is_refused_in_one_line(tmp_path, capsys):
    """A model-only checkpoint (a BERT classifier) has no scene task: one line, exit 2."""
    ckpt = make_checkpoint(tmp_path / "clf", "bert-tiny", n_labels=3)
    assert main(["embodied", "--ckpt", str(ckpt), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained on task None, not on scenes" in err
