"""Loss curves from a run's metrics.jsonl: train and validation loss, learning rate on a 2nd axis.

`load_metrics` returns the series (data); `loss_figure` draws them and returns the Figure (whose
lines hold exactly the plotted points); `plot_loss` writes that figure as a PNG.
"""

import json
from pathlib import Path

from matplotlib.figure import Figure

from attnlab.viz.figures import finish

LOSS_KEYS = ("train_loss", "val_loss")


def load_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Series keyed by metric name, each a list of (step, value), later lines overriding earlier
    ones at the same step (a resumed run rewrites the steps after its checkpoint).

    `path` is a metrics.jsonl file or a run directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics file at {str(path)!r}")
    series: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, {})[record["step"]] = value
    return {k: sorted(v.items()) for k, v in series.items()}


def loss_figure(metrics: dict[str, list[tuple[int, float]]], title: str = "") -> Figure:
    """Train/validation loss on the left axis, learning rate (grey) on the right axis."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for key, style in zip(LOSS_KEYS, ("-", "o-")):
        if metrics.get(key):
            steps, values = zip(*metrics[key])
            ax.plot(steps, values, style, label=key.replace("_", " "), markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if metrics.get("lr"):
        ax2 = ax.twinx()
        steps, values = zip(*metrics["lr"])
        ax2.plot(steps, values, color="gray", alpha=0.5, label="learning rate")
        ax2.set_ylabel("learning rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")
    ax.set_title(title)
    return fig


def plot_loss(
    metrics: dict[str, list[tuple[int, float]]], out: str | Path, title: str = ""
) -> Path:
    """Draw train/validation loss (left axis) and learning rate (right axis) to a PNG."""
    finish(loss_figure(metrics, title), out)
    return Path(out)
