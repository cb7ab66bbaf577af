"""viz/loss.py: metrics.jsonl is read back step by step, and the figure draws those points."""

import json

import numpy as np
import pytest

from attnlab.viz.loss import load_metrics, loss_figure, plot_loss


@pytest.fixture
def run_dir(tmp_path):
    records = [
        {"step": s, "train_loss": 5.0 - 0.1 * s, "lr": 1e-3 * min(1, s / 5)}
        for s in range(0, 30, 2)
    ]
    records += [{"step": s, "val_loss": 5.2 - 0.1 * s} for s in (10, 20)]
    records.append({"step": 20, "val_loss": 3.0, "sample": "text"})  # a resumed run rewrote 20
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return tmp_path


def test_load_metrics_from_file_or_run_dir(run_dir):
    m = load_metrics(run_dir)
    assert m == load_metrics(run_dir / "metrics.jsonl")
    assert m["val_loss"] == [(10, pytest.approx(4.2)), (20, 3.0)]
    assert [s for s, _ in m["train_loss"]] == list(range(0, 30, 2))
    assert "sample" not in m
    with pytest.raises(ValueError, match="no metrics"):
        load_metrics(run_dir / "missing")


def test_figure_draws_train_val_and_lr_on_a_second_axis(run_dir, tmp_path):
    m = load_metrics(run_dir)
    fig = loss_figure(m, title="run")
    loss_ax, lr_ax = fig.axes
    train, val = loss_ax.get_lines()
    np.testing.assert_array_equal(train.get_xdata(), [s for s, _ in m["train_loss"]])
    np.testing.assert_array_equal(train.get_ydata(), [v for _, v in m["train_loss"]])
    np.testing.assert_array_equal(val.get_ydata(), [v for _, v in m["val_loss"]])
    (lr,) = lr_ax.get_lines()
    np.testing.assert_array_equal(lr.get_ydata(), [v for _, v in m["lr"]])
    assert lr_ax.get_ylabel() == "learning rate"
    labels = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert labels == ["train loss", "val loss", "learning rate"]
    out = plot_loss(m, tmp_path / "loss.png", title="run")
    assert out.read_bytes()[:4] == b"\x89PNG"
