"""Pictures of activation patching and logit attribution (the numbers: attnlab/lab/patching.py).

    plot_patching({"resid_pre": (L, T), ...}, tokens)   one heat map per kind, layer x position
                                                        (layer x head for "head")
    plot_attribution(heads (L, H), layers (L, 2), lens (L + 1,))   DLA per head and per layer,
                                                        and the logit lens

Each returns its Figure; with `out` it is also written as a PNG. Patching maps share one
diverging scale centred on 0 (1 = the clean answer fully restored).
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from attnlab.viz.figures import finish


def _diverging(ax, a: np.ndarray, fig: Figure, limit: float):
    im = ax.imshow(a, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    fig.colorbar(im, ax=ax, fraction=0.05)
    return im


def plot_patching(
    maps: dict, tokens: Sequence[str] = (), out: str | Path | None = None, title: str = ""
) -> Figure:
    """One heat map per patching kind: rows layers, columns positions (or heads).

    Args:
        maps: {kind: (L, T) or (L, H) array}, normalised (0 = corrupted, 1 = clean).
        tokens: the T clean tokens, to label the position axes.
    """
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in maps.items()}
    limit = max(1.0, *(np.abs(a).max() for a in arrays.values()))
    cells = max(a.shape[1] for a in arrays.values())
    cols = min(len(arrays), 4 if cells <= 12 else 2)  # a long prompt: two maps a row
    rows = -(-len(arrays) // cols)
    L = next(iter(arrays.values())).shape[0]
    height = 1.6 + min(0.35 * L, 7.0)  # a 30-layer model stays on a page
    fig = Figure(figsize=(cols * (2.2 + 0.4 * cells), rows * height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(arrays) :]:
        ax.set_visible(False)
    for ax, (kind, a) in zip(axes, arrays.items()):
        _diverging(ax, a, fig, limit)
        ax.set_title(kind.replace("_", " "), fontsize=9)
        ax.set_ylabel("layer")
        ax.set_yticks(range(a.shape[0]))
        ax.set_xticks(range(a.shape[1]))
        if kind == "head":
            ax.set_xlabel("head")
        else:
            ax.set_xlabel("position")
            if len(tokens) == a.shape[1]:
                ax.set_xticklabels([repr(t)[1:-1] for t in tokens], rotation=90, fontsize=7)
    if title:
        fig.suptitle(title)
    return finish(fig, out, tight=False)  # constrained layout leaves room for the title


def plot_attribution(
    heads, layers, lens: dict, out: str | Path | None = None, title: str = ""
) -> Figure:
    """Direct logit attribution per head and per layer (attention, MLP), and the logit lens.

    Args:
        heads: (L, H).  layers: (L, 2) attention and MLP.  lens: {run: (L + 1,)} the metric
            read off each residual stream (embeddings first).
    """
    heads, layers = np.asarray(heads, np.float64), np.asarray(layers, np.float64)
    L, H = heads.shape
    fig = Figure(figsize=(5 + 0.4 * H, 1.8 + min(0.35 * L, 7.0)), layout="constrained")
    ax_h, ax_l, ax_lens = fig.subplots(1, 3, gridspec_kw={"width_ratios": [max(H, 2), 2, 5]})
    limit = max(1e-6, np.abs(heads).max(), np.abs(layers).max())
    for ax, a, xlabel, ticks in (
        (ax_h, heads, "head", [str(h) for h in range(H)]),
        (ax_l, layers, "", ["attn", "mlp"]),
    ):
        _diverging(ax, a, fig, limit)
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_yticks(range(L))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
    ax_h.set_title("DLA per head", fontsize=9)
    ax_l.set_title("per layer", fontsize=9)
    for run, values in lens.items():
        ax_lens.plot(range(-1, L), np.asarray(values, np.float64), marker="o", ms=3, label=run)
    ax_lens.set_xlabel("after block (-1: embeddings)", fontsize=8)
    ax_lens.set_title("logit lens", fontsize=9)
    ax_lens.axhline(0, color="k", lw=0.5)
    ax_lens.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return finish(fig, out, tight=False)
