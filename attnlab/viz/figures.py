"""Shared plotting plumbing: figures are built object-oriented (no pyplot global state), so
they are safe to make in tests and threads, and each plot_* returns its Figure for inspection."""

from pathlib import Path

from matplotlib.figure import Figure

DPI = 120


def finish(fig: Figure, out: str | Path | None, tight: bool = True) -> Figure:
    """Lay the figure out and, when `out` is given, write it as a PNG (parents created)."""
    if tight:
        fig.tight_layout()
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI)
    return fig


def image_array(fig: Figure, index: int = 0):
    """The array drawn by the `index`-th image (imshow) in the figure, across all axes."""
    images = [im for ax in fig.axes for im in ax.images]
    return images[index].get_array()
