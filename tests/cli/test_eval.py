"""`attnlab eval` on a freshly trained tiny seq2seq checkpoint reports exact match."""

import pytest
import torch

from attnlab.cli.__main__ import main
from tests.viz.checkpoints import make_checkpoint


@pytest.mark.slow
def test_eval_reports_exact_match(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    args = [
        "train",
        "--preset",
        "transformer-tiny",
        "--data.task",
        "seq2seq",
        "--data.source",
        "synthetic:copy",
        "--data.synthetic_n_val",
        "16",
        "--train.steps",
        "2",
        "--train.batch_size",
        "4",
        "--train.progress",
        "false",
        "--train.out_dir",
        str(out),
        "--train.device",
        "cpu",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out / "checkpoints" / "latest_unused")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    assert (
        main(["eval", "--ckpt", str(out / "checkpoints" / "step_000002"), "--device", "cpu"]) == 0
    )
    printed = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert set(printed) == {"val_loss", "val_exact_match"}
    assert 0.0 <= float(printed["val_exact_match"]) <= 1.0


def test_a_classifier_is_refused_in_one_line(tmp_path, capsys):
    """Issue 18: a BERT classifier opens, and eval says why it has nothing to score it on."""
    ckpt = make_checkpoint(tmp_path / "clf", "bert-tiny", n_labels=3)
    assert main(["eval", "--ckpt", str(ckpt), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sequence classifier (3 labels)" in err
