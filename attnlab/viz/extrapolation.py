"""Loss vs position for `attnlab lab extrapolate` (attnlab/lab/extrapolate.py): one curve per
variant, in three panels (the position schemes; RoPE scaled without, and with, a fine-tune), a
vertical line at the training length L, positions on a log axis.

A record is one variant's measurement as the experiment stores it: {"name", "scaling" (None or
"linear" / "ntk" / "dynamic" / "yarn"), "factor", "finetuned", "per_position": [loss or None]},
entry i - 1 being the loss at 1-based position i.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from attnlab.viz.figures import finish

SMOOTH = 0.125  # the picture averages position p's loss over p +- 12.5%


def smooth(values: np.ndarray, spread: float = SMOOTH) -> np.ndarray:
    """Average of position p's neighbours within p * spread on either side (a window that grows
    with p, even on a log axis); positions without a loss (NaN) are skipped and stay NaN."""
    ok = np.isfinite(values)
    total = np.concatenate(([0.0], np.cumsum(np.where(ok, values, 0.0))))
    count = np.concatenate(([0], np.cumsum(ok)))
    p = np.arange(1, len(values) + 1)
    lo = np.maximum(p - np.floor(p * spread), 1).astype(int) - 1  # 0-based, inclusive
    hi = np.minimum(p + np.floor(p * spread), len(values)).astype(int)  # exclusive
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ok, (total[hi] - total[lo]) / (count[hi] - count[lo]), np.nan)


def extrapolation_figure(records: list[dict], context: int) -> Figure:
    """Loss vs position: the schemes, RoPE scalings without and with the fine-tune."""
    panels = [
        ("position schemes (trained at L)", lambda r: r["scaling"] is None),
        ("RoPE scaled, no fine-tune", lambda r: r["scaling"] is not None and not r["finetuned"]),
        ("RoPE scaled, fine-tuned at f x L", lambda r: r["finetuned"]),
    ]
    fig = Figure(figsize=(16, 4.8))
    axes = fig.subplots(1, 3, sharey=True)
    styles = {2: "-", 4: "--", 8: ":"}
    colors = {"linear": "C0", "ntk": "C1", "dynamic": "C2", "yarn": "C3"}
    lows = []
    for ax, (title, keep) in zip(axes, panels):
        for i, r in enumerate(x for x in records if keep(x)):
            y = np.array([np.nan if v is None else v for v in r["per_position"]])
            y = smooth(y)
            lows.append(np.nanmin(y))
            pos = np.arange(1, len(y) + 1)
            if r["scaling"] is None:
                ax.plot(pos, y, label=r["name"], color=f"C{i}", lw=1.2)
            else:
                ax.plot(pos, y, styles[r["factor"]], color=colors[r["scaling"]], label=r["name"])
        ax.axvline(context, color="k", lw=0.8)
        ax.text(context, 1.0, " L", transform=ax.get_xaxis_transform(), va="top")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("position (tokens read)")
        ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel(f"validation loss (nats/token), averaged over position +-{SMOOTH:.1%}")
    lo = min(lows)
    axes[0].set_ylim(lo - 0.1, lo + 3.0)
    return fig


def plot_extrapolation(records: list[dict], context: int, out: str | Path) -> Path:
    """Draw `extrapolation_figure` to a PNG."""
    finish(extrapolation_figure(records, context), out)
    return Path(out)
