"""Pictures of what heads do (the numbers come from attnlab/lab/heads.py).

    plot_head_scores({"importance": (L, H), ...})   one layer x head heatmap per score
    plot_pruning(pruning)                           loss against the fraction of heads masked
    plot_induction_check(scores, check)             induction score beside per-head patching

Each returns its Figure; with `out` it is also written as a PNG.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from attnlab.viz.figures import finish


def plot_head_scores(scores: dict, out: str | Path | None = None, title: str = "") -> Figure:
    """One heatmap per score, side by side, rows = layers, columns = heads, all on one colour
    scale from 0 to 1 (every score is a fraction of attention or a normalised importance), so a
    score near 0 looks near 0 rather than being stretched over the colours.

    Args:
        scores: {name: (L, H) array or tensor}, every score of the same shape.
    """
    arrays = {name: np.asarray(s, dtype=np.float64) for name, s in scores.items()}
    n = len(arrays)
    L, H = next(iter(arrays.values())).shape
    fig = Figure(figsize=(2.2 + 0.35 * H * n, 1.2 + 0.35 * L))
    for ax, (name, s) in zip(fig.subplots(1, n, squeeze=False)[0], arrays.items()):
        im = ax.imshow(s, cmap="viridis", vmin=0, vmax=max(1.0, s.max()), aspect="auto")
        ax.set_title(name.replace("_", " "), fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        fig.colorbar(im, ax=ax, fraction=0.05)
    if title:
        fig.suptitle(title)
    return finish(fig, out)


def plot_pruning(pruning: dict, out: str | Path | None = None) -> Figure:
    """Loss against the fraction of heads masked: by importance (per-layer normalised and not)
    and each random order, with the +tolerance line above the unpruned loss.

    Args:
        pruning: {"fractions", "by_importance", "by_raw_importance", "random": [curves],
            "tolerance"} as `heads_lab` writes it.
    """
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    x = pruning["fractions"]
    for i, curve in enumerate(pruning["random"]):
        ax.plot(x, curve, color="gray", alpha=0.6, label="random order" if i == 0 else None)
    ax.plot(x, pruning["by_importance"], color="C3", marker="o", ms=3, label="by importance")
    raw = pruning["by_raw_importance"]
    ax.plot(x, raw, color="C0", marker="s", ms=3, label="by importance, not normalised")
    base = pruning["by_importance"][0]
    tolerance = pruning["tolerance"]
    ax.axhline(base * (1 + tolerance), color="k", ls=":", lw=1, label=f"+{tolerance:.0%} loss")
    ax.set_xlabel("fraction of heads masked")
    ax.set_ylabel("loss (held-out batches)")
    ax.legend()
    return finish(fig, out)


def plot_induction_check(scores, check: dict, out: str | Path | None = None) -> Figure:
    """The induction score (L, H) beside what patching each head alone from [r, r] into [r', r]
    restores (lab/induction.py), each on its own colour scale, the top heads by score ringed.

    Args:
        scores: (L, H) induction scores.  check: `induction_check`'s dict.
    """
    panels = {
        "induction score": np.asarray(scores, dtype=np.float64),
        "patching one head restores": np.asarray(check["patching"]["per_head"], dtype=np.float64),
    }
    L, H = panels["induction score"].shape
    fig = Figure(figsize=(2.4 + 0.7 * H, 1.2 + 0.22 * L))
    for ax, (name, s) in zip(fig.subplots(1, 2), panels.items()):
        im = ax.imshow(s, cmap="viridis", vmin=min(0.0, s.min()), vmax=s.max(), aspect="auto")
        layers, heads = zip(*check["heads"])
        ax.scatter(heads, layers, s=60, facecolors="none", edgecolors="red", linewidths=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(0, L, max(1, L // 10)))
        fig.colorbar(im, ax=ax, fraction=0.05)
    return finish(fig, out)
