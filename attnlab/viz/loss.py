"""Loss curves from a run's metrics.jsonl: train and validation loss, learning rate on a second axis."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Series keyed by metric name, each a list of (step, value), later lines overriding earlier
    ones at the same step (a resumed run rewrites the steps after its checkpoint)."""
    series: dict[str, dict[int, float]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                series.setdefault(key, {})[record["step"]] = value
    return {k: sorted(v.items()) for k, v in series.items()}


def plot_loss(
    metrics: dict[str, list[tuple[int, float]]], out: str | Path, title: str = ""
) -> Path:
    """Draw train/validation loss (left axis) and learning rate (right axis) to a PNG."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        if key in metrics:
            steps, values = zip(*metrics[key])
            ax.plot(steps, values, style, label=key.replace("_", " "), markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if "lr" in metrics:
        ax2 = ax.twinx()
        steps, values = zip(*metrics["lr"])
        ax2.plot(steps, values, color="gray", alpha=0.5, label="learning rate")
        ax2.set_ylabel("learning rate")
    ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
