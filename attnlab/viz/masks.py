"""Pictures of attention masks: which key (column) each query (row) may attend to.

`mask_grids` builds every mask with the library's own builders (components/masks.py), so the
picture shows what the models use; `plot_masks` draws them side by side. True = may attend.
"""

from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from attnlab.components.masks import (
    causal_mask,
    padding_mask,
    permutation_mask,
    prefix_lm_mask,
    sliding_window_mask,
)
from attnlab.viz.figures import finish

_CMAP = ListedColormap(["#f2f2f2", "#2b6cb0"])  # masked, may attend


def mask_grids(
    seq_len: int = 8,
    n_padding: int = 2,
    window: int = 3,
    prefix: int = 3,
    order: tuple[int, ...] | None = None,
) -> dict[str, np.ndarray]:
    """Every mask kind for one sequence of `seq_len` tokens, each a (T, T) bool array.

    Args:
        seq_len: T.  n_padding: padding tokens at the end (for "padding" and "causal + padding").
        window: sliding-window size (each query sees itself and window - 1 keys back).
        prefix: prefix-LM prefix length.
        order: XLNet factorisation order (a permutation of range(T)); default a fixed shuffle.

    Returns:
        {name: (T, T) bool} in a fixed order: padding, causal, causal + padding,
        sliding window, prefix-LM, permutation (XLNet query stream).
    """
    if not 0 <= n_padding < seq_len:
        raise ValueError(f"n_padding must be in [0, {seq_len}), got {n_padding}")
    T = seq_len
    valid = torch.arange(T)[None, :] < T - n_padding  # (1, T): real tokens first, padding last
    pad = padding_mask(valid, T)[0, 0]  # (T, T)
    if order is None:
        order = torch.randperm(T, generator=torch.Generator().manual_seed(0)).tolist()
    grids = {
        f"padding ({n_padding} pad)": pad,
        "causal": causal_mask(T),
        "causal + padding": causal_mask(T) & pad,
        f"sliding window (w={window})": sliding_window_mask(T, window),
        f"prefix-LM (prefix={prefix})": prefix_lm_mask(T, prefix),
        f"permutation {list(order)}": permutation_mask(torch.tensor(order)),
    }
    return {name: m.numpy() for name, m in grids.items()}


def plot_masks(grids: dict[str, np.ndarray], out: str | Path | None = None) -> Figure:
    """One panel per mask: blue = may attend, grey = masked; query down, key across."""
    n = len(grids)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(3.4 * cols, 3.4 * rows))
    for i, (name, grid) in enumerate(grids.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.imshow(grid, cmap=_CMAP, vmin=0, vmax=1, interpolation="nearest")
        T, S = grid.shape
        ax.set_xticks(range(S))
        ax.set_yticks(range(T))
        ax.tick_params(labelsize=7)
        ax.set_xticks(np.arange(-0.5, S), minor=True)
        ax.set_yticks(np.arange(-0.5, T), minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="minor", length=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key j", fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
    fig.suptitle("Attention masks (blue = may attend)")
    return finish(fig, out)
