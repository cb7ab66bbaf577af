"""Pictures of the rank analysis (the numbers come from attnlab/analysis/rank.py).

The rows are attnlab.analysis.rank.RankRow records; they are read by field only, and not
imported, because the analysis builds on viz (it captures attention with viz.capture).

plot_rank draws rank against sequence length n: one panel per d_k for the random-weight rows,
the singular-value spectra of one random head, and one panel per weight source (init, trained)
for rows measured on a model.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from attnlab.viz.figures import finish


def _log_axes(ax, ns: list[int]) -> None:
    """Log-log axes labelled at the measured n only."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")


def _random_panel(ax, rows: list, d_k: int) -> None:
    rows = [r for r in rows if r.d_k == d_k]
    ns = sorted({r.n for r in rows})
    heads = sorted({r.n_heads for r in rows})
    ax.plot(ns, ns, color="0.6", ls="--", lw=1, label="n (full rank)")
    ax.plot(ns, [min(n, d_k) for n in ns], color="0.6", ls=":", lw=1, label="min(n, d_k)")

    def series(H, get):
        return [get(next(r for r in rows if r.n == n and r.n_heads == H)) for n in ns]

    ax.plot(ns, series(heads[0], lambda r: r.logits_rank), "s-", ms=4, label="rank Q K^T")
    for H in heads:
        if H == 1:
            ax.plot(
                ns,
                series(H, lambda r: r.head_rank[0]),
                "o-",
                ms=8,
                mfc="none",
                mew=1.5,
                label="rank P (one head)",
            )
            ax.plot(
                ns, series(H, lambda r: r.head_energy_rank), "o:", ms=4, label="99%-energy rank P"
            )
        else:
            ax.plot(
                ns,
                series(H, lambda r: r.joint_rank),
                "^-",
                ms=4,
                label=f"rank [P_1..P_{H}] ({H} heads)",
            )
            ax.plot(
                ns,
                series(H, lambda r: r.joint_energy_rank),
                "^:",
                ms=4,
                label=f"99%-energy [P_1..P_{H}]",
            )
    ax.set(xlabel="sequence length n", ylabel="rank", title=f"random weights, d_k = {d_k}")
    _log_axes(ax, ns)
    ax.legend(fontsize=7)


def _model_panel(ax, rows: list, source: str) -> None:
    rows = [r for r in rows if r.source.startswith(source + " ")]
    ns = sorted({r.n for r in rows})
    ax.plot(ns, ns, color="0.6", ls="--", lw=1, label="n (full rank)")
    for layer in sorted({r.source[len(source) + 1 :] for r in rows}):
        mine = sorted((r for r in rows if r.source == f"{source} {layer}"), key=lambda r: r.n)
        (line,) = ax.plot(
            [r.n for r in mine],
            [r.head_rank[0] for r in mine],
            "o-",
            ms=4,
            label=f"{layer}: min rank P_h",
        )
        ax.plot(
            [r.n for r in mine],
            [r.head_energy_rank for r in mine],
            "o:",
            ms=3,
            color=line.get_color(),
            label=f"{layer}: 99%-energy",
        )
    ax.set(xlabel="sequence length n", ylabel="rank", title=f"{source} weights")
    _log_axes(ax, ns)
    ax.legend(fontsize=6)


def plot_rank(
    rows: list,
    spectra: dict[int, np.ndarray] | None = None,
    spectra_d_k: int | None = None,
    out: str | Path | None = None,
) -> Figure:
    """Rank against n for every group of rows, plus normalised spectra sigma_i / sigma_1.

    Args:
        rows: from random_rank_table and/or model_rank_table.
        spectra: {n: sigma / sigma_1} of one random head (random_spectra), or None.
        spectra_d_k: the d_k the spectra were measured at (for the title).
    """
    random_rows = [r for r in rows if r.source == "random"]
    sources = sorted({r.source.split()[0] for r in rows if r.source != "random"})
    d_ks = sorted({r.d_k for r in random_rows})
    top = len(d_ks) + (spectra is not None)
    n_rows = (top > 0) + (len(sources) > 0)
    n_cols = max(top, len(sources))
    fig = Figure(figsize=(5.2 * n_cols, 4.6 * n_rows))
    grid = fig.add_gridspec(n_rows, n_cols)
    for i, d_k in enumerate(d_ks):
        _random_panel(fig.add_subplot(grid[0, i]), random_rows, d_k)
    if spectra is not None:
        ax = fig.add_subplot(grid[0, len(d_ks)])
        for n, s in spectra.items():
            ax.plot(np.arange(1, len(s) + 1), s, label=f"n = {n}")
            ax.axhline(len(s) * np.finfo(np.float64).eps, color="0.7", lw=0.8, ls=":")
        ax.set(
            yscale="log",
            xlabel="index i",
            ylabel="sigma_i / sigma_1",
            title=f"spectrum of P, one random head (d_k = {spectra_d_k})",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="dotted: tol = n * eps", title_fontsize=7)
    for i, source in enumerate(sources):
        _model_panel(fig.add_subplot(grid[n_rows - 1, i]), rows, source)
    return finish(fig, out)
